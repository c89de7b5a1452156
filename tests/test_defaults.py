"""Defaults a user gets without configuring anything: the model, and shared rounds."""

import pytest
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


def test_shared_rounds_are_on_by_default(monkeypatch):
    """Every open request shares each round unless SANCTUM_MAX_BATCH (or --max-batch) says
    otherwise; 1 is one request's round at a time, below 1 an error naming the variable."""
    for name in ("SANCTUM_MAX_BATCH", "SANCTUM_MAX_ACTIVE"):
        monkeypatch.delenv(name, raising=False)
    assert settings.serve_settings().max_batch == settings.serve_settings().max_active == 8
    assert settings.serve_settings(max_active=3).max_batch == 3
    monkeypatch.setenv("SANCTUM_MAX_BATCH", "1")
    assert settings.serve_settings().max_batch == 1
    monkeypatch.setenv("SANCTUM_MAX_BATCH", "0")
    with pytest.raises(ValueError, match="SANCTUM_MAX_BATCH"):
        settings.serve_settings()


def test_a_shared_rollback_takes_views_unless_another_way_is_asked_for(monkeypatch):
    """SANCTUM_SHARED_ROLLBACK: views by default, gather or rerun on request, anything else
    refused."""
    from sanctum.settings import device_settings

    assert device_settings({}).shared_rollback == "views"
    assert device_settings({"SANCTUM_SHARED_ROLLBACK": "gather"}).shared_rollback == "gather"
    assert device_settings({"SANCTUM_SHARED_ROLLBACK": "rerun"}).shared_rollback == "rerun"
    with pytest.raises(ValueError, match="SANCTUM_SHARED_ROLLBACK"):
        device_settings({"SANCTUM_SHARED_ROLLBACK": "copy"})


def test_wide_rows_kernel_is_chosen_at_load_unless_set():
    """SANCTUM_QMM_WIDE: auto (the tiled kernel where it passed, else the wide one) by default,
    wide or off on request, anything else refused."""
    from sanctum.settings import device_settings

    assert device_settings({}).qmm_wide == "auto"
    assert device_settings({"SANCTUM_QMM_WIDE": "wide"}).qmm_wide == "wide"
    with pytest.raises(ValueError, match="SANCTUM_QMM_WIDE"):
        device_settings({"SANCTUM_QMM_WIDE": "tiles"})


def test_tiled_kernel_keeps_one_tile_of_weights_ahead_unless_set():
    """SANCTUM_QMM_TILED_AHEAD: 1 by default, 2 or 3 on request, anything else refused."""
    from sanctum.settings import device_settings

    assert device_settings({}).qmm_tiled_ahead == 1
    assert device_settings({"SANCTUM_QMM_TILED_AHEAD": "3"}).qmm_tiled_ahead == 3
    with pytest.raises(ValueError, match="SANCTUM_QMM_TILED_AHEAD"):
        device_settings({"SANCTUM_QMM_TILED_AHEAD": "4"})


def test_tiled_kernel_holds_one_block_an_sm_unless_set():
    """SANCTUM_QMM_TILED_RESIDENT: 1 by default, 2 on request, anything else refused."""
    from sanctum.settings import device_settings

    assert device_settings({}).qmm_tiled_resident == 1
    assert device_settings({"SANCTUM_QMM_TILED_RESIDENT": "2"}).qmm_tiled_resident == 2
    with pytest.raises(ValueError, match="SANCTUM_QMM_TILED_RESIDENT"):
        device_settings({"SANCTUM_QMM_TILED_RESIDENT": "3"})
