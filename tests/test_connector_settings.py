"""BIDIRKV_* settings (bidirkv/connector/settings.py)."""

import pytest

from bidirkv.connector.settings import CPU_IDLE_POLL_MS, CPU_PROGRESS_WAIT_US, Settings


def test_defaults_act_on_cpu_only():
    s = Settings.from_env({})
    cpu, gpu = s.resolve(is_cpu=True), s.resolve(is_cpu=False)
    assert cpu.keep_affinity and cpu.nixl_progress_thread is True
    assert cpu.nixl_progress_wait_us == CPU_PROGRESS_WAIT_US
    assert cpu.idle_poll_ms == CPU_IDLE_POLL_MS and cpu.stream_params
    # Elsewhere: vLLM's own progress thread, loop and worker busy-wait stay as they are.
    assert gpu.nixl_progress_thread is None and gpu.idle_poll_ms == 0
    assert gpu.nixl_progress_wait_us == 0
    assert s.handle_key is None


def test_explicit_values_win_on_every_platform():
    s = Settings.from_env({
        "BIDIRKV_CPU_KEEP_AFFINITY": "0", "BIDIRKV_NIXL_PROGRESS_THREAD": "on",
        "BIDIRKV_IDLE_POLL_MS": "5", "BIDIRKV_STREAM_PARAMS": "false",
        "BIDIRKV_HANDLE_KEY": "s3cret",
    })
    for is_cpu in (True, False):
        r = s.resolve(is_cpu)
        assert not r.keep_affinity and r.nixl_progress_thread is True
        assert r.idle_poll_ms == 5 and not r.stream_params
    assert s.handle_key == b"s3cret"
    assert Settings.from_env({"BIDIRKV_IDLE_POLL_MS": "0"}).resolve(True).idle_poll_ms == 0


@pytest.mark.parametrize("env", [
    {"BIDIRKV_CPU_KEEP_AFFINITY": "maybe"}, {"BIDIRKV_NIXL_PROGRESS_THREAD": "2"},
    {"BIDIRKV_IDLE_POLL_MS": "-1"}, {"BIDIRKV_IDLE_POLL_MS": "5000"},
    {"BIDIRKV_IDLE_POLL_MS": "fast"},
])
def test_typos_fall_back_to_auto_with_a_warning(env, caplog):
    assert Settings.from_env(env) == Settings()
    assert "using auto" in caplog.text


def test_residency_knobs_take_the_crds_definition():
    """The CRD, the router and decode read retentionWatermark and ownerLeaseSeconds with
    one type, bounds and default (bidirkv/knobs.py)."""
    from bidirkv.knobs import KvKnobs

    defaults = Settings.from_env({})
    assert (defaults.retention_watermark, defaults.owner_lease_s) == (
        KvKnobs().retention_watermark, KvKnobs().owner_lease_seconds) == (0.9, 30)
    s = Settings.from_env({"BIDIRKV_RETENTION_WATERMARK": "0.05",
                           "BIDIRKV_OWNER_LEASE_SECONDS": "86400"})
    assert (s.retention_watermark, s.owner_lease_s) == (0.05, 86400)


@pytest.mark.parametrize(("name", "raw", "needle"), [
    ("BIDIRKV_RETENTION_WATERMARK", "0.04", "greater than or equal to 0.05"),
    ("BIDIRKV_RETENTION_WATERMARK", "1.01", "less than or equal to 1"),
    ("BIDIRKV_OWNER_LEASE_SECONDS", "30.5", "valid integer"),
    ("BIDIRKV_OWNER_LEASE_SECONDS", "0", "greater than or equal to 1"),
    ("BIDIRKV_OWNER_LEASE_SECONDS", "soon", "Invalid JSON"),
])
def test_a_residency_knob_out_of_its_bounds_falls_back_with_a_warning(name, raw, needle,
                                                                       caplog):
    assert Settings.from_env({name: raw}) == Settings()
    assert name in caplog.text and repr(raw) in caplog.text and needle in caplog.text
