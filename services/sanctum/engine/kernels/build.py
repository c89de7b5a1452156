"""Every sanctum CUDA kernel is made here, and each build is kept on disk.

MLX builds an `mx.fast.cuda_kernel` with NVRTC at its first call in every process and keeps no
build across processes (MLX 0.32: its PTX cache holds MLX's own kernels, not custom ones), so a
server start, each load-time check's child process and each benchmark paid a build per kernel
and template, every time (docs/performance.md says what that cost a GPU run). This module
writes the kernel's source the way `mx.fast.cuda_kernel` does (the template constants as
`constexpr`s, the inputs as `const T*`, then the outputs), compiles it with the NVRTC that MLX
itself loaded, for this GPU's architecture, keeps the binary under SANCTUM_HOME/cuda-builds/
named by a digest of everything that went into it, and runs it through
`mx.fast.precompiled_cuda_kernel`. Where that cannot be done (no NVRTC found, a compile error,
SANCTUM_CUDA_BUILDS=mlx) the kernel goes through `mx.fast.cuda_kernel` as before. This is what
a library should give (a persistent cache for custom kernels); MLX does not yet."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import threading
from pathlib import Path

import mlx.core as mx

from ... import settings

log = logging.getLogger("sanctum.kernels")

# an input's or output's CUDA type, as mx.fast.cuda_kernel spells it
CUDA_TYPES = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
}
# NVRTC has no standard headers: the fixed-width integers and INFINITY that the kernels use
# (mx.fast.cuda_kernel's builds get them from MLX's own device headers)
PRELUDE = """#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
"""


def source_name(name: str, source: str, header: str = "") -> str:
    """`name` with a digest of `source` and `header`: two kernels of one name and different
    sources never share a build (MLX keeps a process's builds by name)."""
    digest = hashlib.sha256(f"{header}\0{source}".encode()).hexdigest()[:12]
    return f"{name}_{digest}"


def template_suffix(template) -> str:
    """The template constants as a name's suffix (as MLX names a template's build)."""
    parts = []
    for _, value in template:
        if isinstance(value, bool):
            parts.append("t" if value else "f")
        elif isinstance(value, int):
            parts.append(str(value))
        else:  # a dtype: the kernels here take none
            raise TypeError(f"template constant {value!r}: only int and bool are written here")
    return "".join(f"_{p}" for p in parts)


def kernel_source(
    entry: str,
    header: str,
    source: str,
    inputs: list[tuple[str, mx.Dtype]],
    outputs: list[tuple[str, mx.Dtype]],
    template,
) -> str:
    """The compilable text of one build: the prelude, the half-precision headers where a
    parameter needs them, `header`, then `extern "C" __global__ void entry(...)` with the
    template constants and `source` as its body."""
    dtypes = {d for _, d in inputs} | {d for _, d in outputs}
    includes = ""
    if mx.float16 in dtypes:
        includes += "#include <cuda_fp16.h>\n"
    if mx.bfloat16 in dtypes:
        includes += "#include <cuda_bf16.h>\n"
    params = [f"    const {CUDA_TYPES[d]}* {n}" for n, d in inputs]
    params += [f"    {CUDA_TYPES[d]}* {n}" for n, d in outputs]
    constants = "".join(
        f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = "
        f"{('true' if v else 'false') if isinstance(v, bool) else v};\n"
        for k, v in template
    )
    return (
        PRELUDE
        + includes
        + header
        + f'\nextern "C" __global__ void {entry}(\n'
        + ",\n".join(params)
        + ") {\n"
        + constants
        + source
        + "\n}\n"
    )


class Compiler:
    """NVRTC (the library MLX loaded) compiling for this process's GPU; None where not found."""

    def __init__(self, nvrtc: ctypes.CDLL, arch: str, include_paths: list[str]):
        self.nvrtc, self.arch, self.include_paths = nvrtc, arch, include_paths
        major, minor = ctypes.c_int(), ctypes.c_int()
        nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = f"nvrtc {major.value}.{minor.value} {arch}"

    @classmethod
    def find(cls) -> Compiler | None:
        nvrtc = _load(("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"))
        arch = _device_arch()
        if nvrtc is None or arch is None:
            return None
        return cls(nvrtc, arch, _include_paths())

    @classmethod
    def from_wheels(cls, arch: str) -> Compiler | None:
        """NVRTC and CUDA's headers from the nvidia-cuda-nvrtc-cu12 / nvidia-cuda-runtime-cu12
        wheels (dev extras on Linux x86_64), compiling for `arch` on a machine without a GPU;
        None where they are not installed."""
        import importlib.util

        found = []
        for package, sub in (("nvidia.cuda_nvrtc", "lib"), ("nvidia.cuda_runtime", "include")):
            spec = importlib.util.find_spec(package)
            if spec is None or not spec.submodule_search_locations:
                return None
            found.append(Path(next(iter(spec.submodule_search_locations))) / sub)
        libs = sorted(found[0].glob("libnvrtc.so.*[0-9]"))
        if not libs:
            return None
        return cls(ctypes.CDLL(str(libs[0])), arch, [str(found[1])])

    def resources(self, text: str, name: str) -> dict:
        """What ptxas gives the kernel in `text` a thread (registers, spilled bytes) and a block
        (static shared memory bytes), from its `-v` report."""
        report = {}
        self.compile(text, name, ["--ptxas-options=-v"], report)
        found = {}
        for key, pattern in (
            ("registers", r"Used (\d+) registers"),
            ("spill_stores", r"(\d+) bytes spill stores"),
            ("spill_loads", r"(\d+) bytes spill loads"),
            ("smem_bytes", r"(\d+) bytes smem"),
        ):
            m = re.search(pattern, report["log"])
            found[key] = int(m.group(1)) if m else 0
        return found

    def compile(self, text: str, name: str, options=(), report: dict | None = None) -> bytes:
        """The cubin of `text` for this GPU; raises RuntimeError with NVRTC's log. `options`:
        more NVRTC options; `report`: gets NVRTC's log as "log"."""
        lib, prog = self.nvrtc, ctypes.c_void_p()
        _ok(
            lib.nvrtcCreateProgram(
                ctypes.byref(prog), text.encode(), f"{name}.cu".encode(), 0, None, None
            ),
            "nvrtcCreateProgram",
        )
        try:
            opts = [f"--gpu-architecture={self.arch}", "-std=c++17", *options]
            opts += [f"--include-path={p}" for p in self.include_paths]
            arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
            failed = lib.nvrtcCompileProgram(prog, len(opts), arr) != 0
            if failed or report is not None:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                buf = ctypes.create_string_buffer(size.value)
                lib.nvrtcGetProgramLog(prog, buf)
                text_log = buf.value.decode(errors="replace")
                if failed:
                    raise RuntimeError(f"{name}: {text_log[:2000]}")
                report["log"] = text_log
            size = ctypes.c_size_t()
            _ok(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            buf = ctypes.create_string_buffer(size.value)
            _ok(lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
            return buf.raw
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _ok(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed: NVRTC error {code}")


def _load(names) -> ctypes.CDLL | None:
    for name in names:  # by soname: the library MLX loaded is found first
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _device_arch() -> str | None:
    """sm_XY of the GPU MLX runs on (device 0, MLX's), from the driver."""
    cuda = _load(("libcuda.so.1", "libcuda.so"))
    if cuda is None or cuda.cuInit(0) != 0:
        return None
    device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cuda.cuDeviceGet(ctypes.byref(device), 0) != 0:
        return None
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # ..._COMPUTE_CAPABILITY_MAJOR
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)  # ..._COMPUTE_CAPABILITY_MINOR
    return f"sm_{major.value}{minor.value}" if major.value else None


def _include_paths() -> list[str]:
    """Where the half-precision headers are: the CUDA toolkit MLX's own builds include (its
    CUDA_HOME, CUDA_PATH or /usr/local/cuda) and the CCCL headers MLX ships."""
    paths = []
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    if Path(home, "include").is_dir():
        paths.append(str(Path(home, "include")))
    cccl = Path(mx.__file__).parent / "include" / "cccl"
    if cccl.is_dir():
        paths.append(str(cccl))
    return paths


# this process's builds: compiled here, read from disk, left to MLX (no NVRTC, an error)
STATS = {"compiled": 0, "read": 0, "mlx": 0}
_lock = threading.Lock()
_compiler: list = []  # [Compiler | None], found once a process


def compiler() -> Compiler | None:
    with _lock:
        if not _compiler:
            found = None
            if settings.device().cuda_builds == "cache":
                try:
                    found = Compiler.find()
                except Exception as e:  # any failure here: MLX builds them, as before
                    log.warning("NVRTC not usable here, MLX builds the kernels: %s", e)
            _compiler.append(found)
        return _compiler[0]


def identity() -> str:
    """How this process builds its kernels, for the load-time checks' keys (engine/kernels/
    cuda.py): a verdict on one way of building them says nothing of another."""
    cc = compiler()
    return f"built by {cc.version}" if cc is not None else "built by MLX"


def builds_dir() -> Path:
    return Path(settings.device().home) / "cuda-builds"


class Kernel:
    """A CUDA kernel called as an `mx.fast.cuda_kernel` is (inputs, template, grid,
    threadgroup, output_shapes, output_dtypes), each template's build kept on disk."""

    def __init__(self, name: str, inputs: list[str], outputs: list[str], source: str, header=""):
        self.name = source_name(name, source, header)
        self.inputs, self.outputs, self.source, self.header = inputs, outputs, source, header
        self._binaries: dict[str, bytes | None] = {}  # entry -> its cubin (None: MLX builds)
        self._fallback = None

    def entry(self, template, in_dtypes, out_dtypes) -> str:
        """The name of this template's and these dtypes' build."""
        # the dtypes in the name too: MLX keeps a process's modules by the kernel's name
        types = hashlib.sha256(str([*in_dtypes, *out_dtypes]).encode()).hexdigest()[:6]
        return f"{self.name}{template_suffix(template)}_{types}"

    def text(self, entry: str, template, in_dtypes, out_dtypes) -> str:
        """The compilable source of that build (`kernel_source`)."""
        return kernel_source(
            entry,
            self.header,
            self.source,
            list(zip(self.inputs, in_dtypes)),
            list(zip(self.outputs, out_dtypes)),
            template,
        )

    def binary(self, template, in_dtypes, out_dtypes) -> tuple[str, bytes] | None:
        """(entry, cubin) of this template and these dtypes: from memory, from disk, or
        compiled and written there; None where NVRTC is not usable or the compile failed."""
        entry = self.entry(template, in_dtypes, out_dtypes)
        if entry in self._binaries:  # the entry names the template and the dtypes
            found = self._binaries[entry]
            return None if found is None else (entry, found)
        cc = compiler()
        cubin = None
        if cc is not None:
            text = self.text(entry, template, in_dtypes, out_dtypes)
            digest = hashlib.sha256(f"{cc.version}\0{text}".encode()).hexdigest()[:16]
            path = builds_dir() / f"{entry}-{digest}.cubin"
            try:
                cubin = path.read_bytes()
                STATS["read"] += 1
            except OSError:
                try:
                    cubin = cc.compile(text, entry)
                except RuntimeError as e:
                    log.error("kernel %s does not compile, MLX builds it: %s", entry, e)
                else:
                    STATS["compiled"] += 1
                    _write(path, cubin)
        if cubin is None:
            STATS["mlx"] += 1
        self._binaries[entry] = cubin
        return None if cubin is None else (entry, cubin)

    def __call__(
        self,
        inputs,
        grid,
        threadgroup,
        output_shapes,
        output_dtypes,
        template=(),
        init_value=None,
    ):
        built = self.binary(template, [a.dtype for a in inputs], output_dtypes)
        if built is None:
            return self._mlx_kernel()(
                inputs=inputs,
                template=list(template),
                grid=grid,
                threadgroup=threadgroup,
                output_shapes=output_shapes,
                output_dtypes=output_dtypes,
                init_value=init_value,
            )
        entry, cubin = built
        return mx.fast.precompiled_cuda_kernel(
            name=entry,
            compiled_source=cubin,
            inputs=inputs,
            output_shapes=output_shapes,
            output_dtypes=output_dtypes,
            scalars=[],
            grid=grid,
            threadgroup=threadgroup,
            init_value=init_value,
            ensure_row_contiguous=True,  # as mx.fast.cuda_kernel's default: the kernels index flat
        )

    def _mlx_kernel(self):
        if self._fallback is None:
            self._fallback = mx.fast.cuda_kernel(
                name=self.name,
                input_names=self.inputs,
                output_names=self.outputs,
                source=self.source,
                header=self.header,
            )
        return self._fallback


def _write(path: Path, data: bytes) -> None:
    """`data` to `path` whole or not at all (several processes build at once)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("kernel build not kept at %s: %s", path, e)


def cuda_kernel(name: str, inputs: list[str], outputs: list[str], source: str, header: str = ""):
    """A `Kernel` (built at its first call, from disk where an earlier process built it)."""
    return Kernel(name, inputs, outputs, source, header)
