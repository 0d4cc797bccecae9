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
"""``python -m lightning_fsdp.upstream LIGHTNING_SRC``: write this project's change into a Lightning source tree.

It reads this package's own source files at run time and edits the given tree (a git checkout of Lightning, or an
unpacked sdist) in Lightning's layout: the strategy merged into ``src/lightning/fabric/strategies/fsdp.py``, the device
checks into ``strategies/parallel.py``, the loading package as ``src/lightning/fabric/utilities/checkpoint_loading/``,
the connector's GPU-only check for FSDP removed, the tests, the guide, and a CHANGELOG entry. Nothing of Lightning's
code is stored here: the tree is parsed and edited at the positions of its syntax tree. With ``--series``, the change
is committed onto a git checkout as a numbered series of pull requests (``_series.py``). See
``docs/source-fabric/upstream.rst``.
"""

from lightning_fsdp.upstream._apply import Plan, destinations, plan
from lightning_fsdp.upstream._source import UpstreamError

__all__ = ["Plan", "UpstreamError", "destinations", "plan"]
