"""framework: a declarative distributed training framework for PyTorch.

The packages stand in layers; a module imports only from its own package or from one below it
(tests/test_structure.py holds every import, function-level ones too, to this order). From the ground up:

1. ``config``     the schema and each key's rules, instantiate (the allowlist), interpolation, override errors
2. ``record``     what a run records: metrics (and the wandb sink), the train state
3. ``kernels``    fa4, fused cross-entropy, float8, the compute target
4. ``models``     the family registry and records, one folder per family, the shared parts and decoder
5. ``data``       tokenizer, token files, streams, SFT records, sampler
6. ``planner``    layout, topology, stages, cost, plan, search, resolve (config -> plan, once): pure
7. ``freeze``     exported artifacts
8. ``parallel``   this process as a rank, mesh, TP, FSDP/DDP, pipeline, context parallel, compile,
                  the step pieces that the plain and the pipelined step share
9. ``checkpoint`` DCP store, sessions, HF import/export, init_from
10. ``verify``    numerics and consistency checks, the fallback ladder
11. ``train``     the step loop, runner, trainer, profiling, compile cache, plots
12. ``generate``  cached decoding from a checkpoint
13. ``launch``    rules and recipes (checked before launch), entry, ranks, worker, sweep, dry run, docs

Imports that still run up a layer are listed, each with why, in the test (``KNOWN``); that list may
only shrink.

The top-level ``worker``, ``recipes``, ``docs`` and ``plots`` modules are command-line faces only
(``python -m framework.worker`` stays the command line); each runs its module in the layer above.
"""
