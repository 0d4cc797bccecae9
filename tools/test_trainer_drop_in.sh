#!/usr/bin/env bash
# Lightning's own CPU tests of the Trainer's strategies, against `lightning_fsdp.pytorch`'s (see tools/test_drop_in.sh).
# Usage: tools/test_trainer_drop_in.sh [PYTHON]   (default: .venv/bin/python)
exec bash "$(dirname "$0")/test_drop_in.sh" trainer "$@"
