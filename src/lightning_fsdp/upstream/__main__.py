# Copyright The lightning-fsdp developers.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Command line: ``python -m lightning_fsdp.upstream LIGHTNING_SRC [--dry-run] [--notes] [--series]``."""

import argparse
import sys
from pathlib import Path

from lightning_fsdp.upstream import UpstreamError, plan


def main(argv: list[str] | None = None) -> int:
    """Write the change into the tree given on the command line; print the summary. Returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_fsdp.upstream",
        description="Write lightning-fsdp's change into a Lightning source tree (a git checkout or an unpacked sdist).",
    )
    parser.add_argument("tree", type=Path, help="the root of the Lightning source tree, or its src/")
    parser.add_argument("--dry-run", action="store_true", help="print the summary without writing")
    parser.add_argument("--notes", action="store_true", help="also list what a maintainer must edit by hand")
    parser.add_argument(
        "--series",
        action="store_true",
        help="commit the change onto the git checkout's current branch as a numbered series of pull requests",
    )
    parser.add_argument(
        "--descriptions", type=Path, help="with --series: write each pull request's description (Markdown) here"
    )
    args = parser.parse_args(argv)
    if args.series:
        return _series(args.tree, args.descriptions, args.dry_run)
    try:
        result = plan(args.tree)
    except UpstreamError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if not args.dry_run:
        result.write()
    print(result.summary())
    if args.notes:
        print("\n".join(["", "Left for a maintainer:", *(f"  {note}" for note in result.notes)]))
    else:
        print(f"{len(result.notes)} notes for a maintainer (--notes lists them)")
    return 0


def _series(tree: Path, descriptions: Path | None, dry_run: bool) -> int:
    from lightning_fsdp.upstream._series import check_clean_checkout, series

    try:
        if not dry_run:
            check_clean_checkout(tree)
        planned = series(tree)
        hashes = [] if dry_run else planned.commit(descriptions)
    except UpstreamError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    total = len(planned.steps)
    for number, step in enumerate(planned.steps, 1):
        counts = ", ".join(f"{kind} +{a}/-{r}" for kind, (a, r) in planned.counts(number).items())
        commit = hashes[number - 1][:10] if hashes else "(dry run)"
        print(f"{commit} ({number}/{total}) {step.title} [{counts}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
