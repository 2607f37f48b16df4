"""The tenants file (symphony_os/server/tenants.py): what it accepts, and a clear error for the rest."""
import pytest

from symphony_os.lip.limits import ProcessLimits
from symphony_os.server.tenants import Tenants, TenantsFileError


def tenants_file(tmp_path, quota: str):
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.alice]\ntoken = "alice-token"\n{quota}\n')
    return path


@pytest.mark.parametrize("quota", [
    "cpu_time_s = nan",        # compares false with everything: a spinning guest ran for ever
    "wall_time_s = inf",
    "max_kv_pages = inf",      # the server's start raised OverflowError
    "max_processes = 0.5",
    "memory_bytes = 1e30",
    "max_upload_bytes = -1",
    "output_bytes = true",
    "kv_pages_per_process = 9223372036854775807",
    'max_kv_files = "10"',
])
def test_a_quota_that_is_not_a_sane_number_is_refused_in_one_line(tmp_path, quota):
    key = quota.split()[0]
    with pytest.raises(TenantsFileError, match=f"tenant 'alice': {key} must be a"):
        Tenants.from_file(tenants_file(tmp_path, quota))


def test_quotas_become_the_tenants_process_limits(tmp_path):
    tenants = Tenants.from_file(tenants_file(tmp_path, "cpu_time_s = 1.5\nmemory_bytes = 1048576\nmax_processes = 3"
                                                       "\nmax_upload_bytes = 64e6\nwall_time_s = 60"))
    alice = tenants.authenticate("alice-token")
    limits = alice.quotas.process_limits(ProcessLimits())
    assert (limits.cpu_time_s, limits.memory_bytes, alice.quotas.max_processes) == (1.5, 1048576, 3)
    assert alice.quotas.max_upload_bytes == 64_000_000 and isinstance(alice.quotas.max_upload_bytes, int)
