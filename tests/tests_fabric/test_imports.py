"""The package imports where ``torch.distributed`` is unavailable (a torch build without it), as Lightning does."""

import subprocess
import sys
from textwrap import dedent

import lightning_fsdp


def test_import_with_torch_dist_unavailable():
    """As Lightning's own ``test_import_fabric_with_torch_dist_unavailable``: every attribute of ``torch.distributed``
    removed, then the package and every public name imported, and Lightning's strategy constructed through `enable`."""
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
        from lightning_fsdp import FSDPStrategy, ModelParallelStrategy, disable, enable
        from lightning_fsdp.distributed import agreement
        from lightning_fsdp.loading import turns

        names = [getattr(lightning_fsdp, name) for name in lightning_fsdp.__all__]  # convert_checkpoint too
        enable()
        import lightning.fabric

        assert type(lightning.fabric.strategies.FSDPStrategy()) is FSDPStrategy  # what `enable` redirects
        disable()
        print("imported", len(names), FSDPStrategy.__name__, ModelParallelStrategy.__name__)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"imported {len(lightning_fsdp.__all__)} FSDPStrategy ModelParallelStrategy" in result.stdout


def test_the_launcher_of_the_guides_works_after_the_install():
    """`fabric run` imports click, which `lightning` does not install: this package's install brings it."""
    from importlib.metadata import requires

    requirements = [r for r in requires("lightning-fsdp") or [] if "extra ==" not in r]
    assert any(r.replace(" ", "").startswith("click") for r in requirements), requirements
    from lightning.fabric.cli import _main

    assert callable(_main)
