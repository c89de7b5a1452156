"""The serving core: requests and their errors, the verifier's request lifecycle, the scheduler
(one thread owns MLX), the inline backend and its stats. Ray-free, gRPC-free and protobuf-free:
plain types in and out. Built on engine/, cache/, settings.py and tokenizer.py; everything that
serves (inline, the cluster's actors, the front end) runs it.

A request is converted once at each boundary and referenced after that:
- wire -> serving: `GenerateRequest` (requests.py), from the proto or the OpenAI body;
- the client's handle: `Ticket` (scheduler.py), its output queue, cancel flag and deadline;
- text work, off the model's thread: `Prepared` (verifier.py), its prompt tokens;
- on the model's thread: `Active` (verifier.py), holding its Prepared and the engine's
  `Sequence`, the one conversion into engine terms.
Counters: the verifier's `Counters` (stats.py), snapshotted into `Stats` for the Stats RPC and
for the Prometheus collector (metrics.py), which counts only per-request figures itself."""
