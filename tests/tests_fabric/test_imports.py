"""The package imports where ``torch.distributed`` is unavailable (a torch build without it), as Lightning does."""

import subprocess
import sys
from textwrap import dedent

import pytest

pytestmark = pytest.mark.package_only


def test_import_with_torch_dist_unavailable():
    """As Lightning's own ``test_import_fabric_with_torch_dist_unavailable``: every attribute of ``torch.distributed``
    removed, then the package and its public names imported."""
    code = dedent(
        """
        import torch
        try:
            import torch._dynamo.variables.functions
            torch._dynamo.variables.functions._fsdp_param_group = None
        except ImportError:
            pass
        for name in list(torch.distributed.__dict__):
            if not name.startswith("__"):
                delattr(torch.distributed, name)
        torch.distributed.is_available = lambda: False

        class _ProcessGroupStub:
            pass

        torch.distributed.ProcessGroup = _ProcessGroupStub

        import lightning_fsdp
        from lightning_fsdp import CheckpointLoadError, FSDPStrategy, ModelParallelStrategy, enable
        from lightning_fsdp.loading import agreement, turns

        print("imported", FSDPStrategy.__name__, ModelParallelStrategy.__name__)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "imported FSDPStrategy ModelParallelStrategy" in result.stdout
