"""framework: a declarative distributed training framework for PyTorch.

The packages stand in layers; a module imports only from its own package or from one below it
(tests/test_structure.py holds every import, function-level ones too, to this order). From the ground up:

1. ``config``     the schema, instantiate (the allowlist), interpolation, override errors
2. ``kernels``    fa4, fused cross-entropy, float8, the compute target
3. ``models``     model specs and the model itself (with ``model``, which joins ``models`` in this layer)
4. ``data``       tokenizer, token files, streams, SFT records, sampler
5. ``planner``    layout, topology, stages, cost, plan, search: pure, no process group
6. ``checkpoint`` DCP store, sessions, HF import/export, init_from
7. ``freeze``     exported artifacts
8. ``parallel``   mesh, TP, FSDP/DDP, pipeline, context parallel, compile
9. ``verify``     numerics and consistency checks
10. ``train``     the step loop, runner, trainer, metrics sinks, profiling, compile cache, plots
11. ``generate``  cached decoding from a checkpoint
12. ``launch``    rules and recipes (checked before launch), entry, ranks, worker, sweep, dry run, docs

The top-level ``worker``, ``recipes``, ``docs`` and ``plots`` modules are command-line faces only
(``python -m framework.worker`` stays the command line); each runs its module in the layer above.
"""
