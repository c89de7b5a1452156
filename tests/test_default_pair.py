"""The default model: the shipped trained pair, or else a tiny random pair made on first use."""

from sanctum import settings
from sanctum.serving.inline import load_models


def test_without_a_shipped_pair_loading_makes_the_tiny_pair_once(tmp_path, monkeypatch):
    monkeypatch.setattr(settings, "DEFAULT_PAIR", tmp_path / "not-shipped")
    monkeypatch.setenv("SANCTUM_HOME", str(tmp_path / "home"))
    e = settings.engine_settings()
    assert e.model == str(tmp_path / "home" / "tiny" / "target")
    assert not (tmp_path / "home").exists()  # settings only name the paths
    target, drafter = load_models(e)
    assert (
        drafter is not None and (tmp_path / "home" / "tiny" / "drafter" / "config.json").is_file()
    )
    made = (tmp_path / "home" / "tiny" / "target" / "config.json").stat().st_mtime_ns
    load_models(e)  # made once: a second load finds it
    assert (tmp_path / "home" / "tiny" / "target" / "config.json").stat().st_mtime_ns == made
