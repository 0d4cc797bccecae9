"""Memory and time of loading a big checkpoint into an FSDP model: lightning-fsdp against upstream Lightning.

One run writes the checkpoints of a synthetic transformer once (raw module state dict as a torch zip file and as a
legacy pickle, safetensors, and a full Fabric checkpoint with Adam state), then, for each format and implementation,
launches fresh CPU ranks (gloo), or with ``--device cuda`` one GPU per rank (NCCL), that create the model on the meta
device, shard it with FSDP and load the file.
A sampler in this process reads the memory of every rank process while they run; the ranks report when setup ended
and when the load started and ended (the load time is measured inside the ranks: barrier, clock, load, barrier,
clock). After the load every rank checks its shard against checksums of the source, so a fast but wrong load cannot
look good. The result is a Markdown table (and a JSON file with every number).

Memory is the total over all rank processes, as PSS (proportional set size: a page shared by several processes,
such as a memory-mapped checkpoint in the page cache, counts once in total):

- anonymous memory: ``RssAnon`` of ``/proc/<pid>/status``, read every 10 ms. The ranks are separate executables
  that share no anonymous pages, so this equals their ``Pss_Anon``; the run checks that against ``smaps_rollup``.
- file-backed memory: ``Pss_File`` of ``/proc/<pid>/smaps_rollup``. Reading ``smaps_rollup`` walks the page tables
  (about 10 ms per GiB resident on the reference machine), too slow to read for every rank every 10 ms, so it is
  read round-robin in the background and each rank's ``RssFile`` (read every 10 ms) is scaled by the share that
  its nearest ``smaps_rollup`` reading found (``Pss_File / RssFile``).

Each rank also reads its own ``/proc/self/io`` around the load: the bytes it made the kernel fetch from storage
(``read_bytes``) and the bytes its read calls returned (``rchar``), summed per node in the report.

Modules: ``checkpoints`` (the model and the files of every format), ``worker`` (the rank process: load with this
project or upstream, verify), ``sampler`` (memory of the rank processes), ``runner`` (one measured load), ``report``
(the Markdown tables) and ``cli`` (the options, every case in turn).

Run ``python benchmarks/bench_load --help`` (or ``python -m benchmarks.bench_load --help`` from the repository root);
see ``benchmarks/README.md``.
"""
