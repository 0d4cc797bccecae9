#!/usr/bin/env bash
# Lightning's own CPU tests of Fabric's strategies, against `lightning_fsdp`'s (see tools/test_drop_in.sh).
# Usage: tools/test_fabric_drop_in.sh [PYTHON]   (default: .venv/bin/python)
exec bash "$(dirname "$0")/test_drop_in.sh" fabric "$@"
