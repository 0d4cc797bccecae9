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
"""Lightning's master at the commit that the change was checked against, besides the installed release.

Only fingerprints (hashes of the normalised syntax tree) of the definitions that the change replaces or calls and
that differ on master from the release: no code of Lightning's. To move the pin, check out the new commit, run
Lightning's tests on the patched tree (docs/source-fabric/upstream.rst), and regenerate them with
``python -c "from lightning_fsdp.upstream._apply import pinned_fingerprints; print(pinned_fingerprints(TREE))"``.
"""

PINNED_MASTER_COMMIT = "7f0c3436cd3f6ad3753125672024fc415cbcb414"
PINNED_MASTER_DEFINITIONS: dict[str, dict[str, str]] = {
    "lightning.fabric.strategies.fsdp": {
        "FSDPStrategy.load_checkpoint": "8aa98f93d4223fff",
        "FSDPStrategy.module_sharded_context": "1e7947b4afb67167",
        "FSDPStrategy.save_checkpoint": "da61b669dd0bc05f",
        "FSDPStrategy.setup_module": "d5a5dc169b76cbb8",
        "_get_full_state_dict_context": "493c0b8dd6a534da",
        "_is_sharded_checkpoint": "8304a94a5d7b2e18",
    },
    "lightning.fabric.strategies.model_parallel": {
        "ModelParallelStrategy.load_checkpoint": "bc07231a24355104",
        "_load_checkpoint": "942b067d134cc835",
        "_load_raw_module_state_from_path": "86366f904e51c869",
    },
}
