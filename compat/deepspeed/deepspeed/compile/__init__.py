"""DeepSpeed's ``deepspeed.compile`` (DeepCompile) package.

shardwise does not run DeepCompile's graph passes (``engine.compile()`` compiles each block with
torch.compile, docs/compile.md). The modules here carry DeepCompile's pure-Python bookkeeping with
DeepSpeed 0.19.8's names and behaviour -- the pass-contract registry and schedule validation, the pass
schedule and compiled-backward bookkeeping, the graph helpers and scheduler over ``torch.fx`` graphs --
so code and tests that drive those pieces directly work. What needs DeepSpeed's compiled ``dc`` ops
answers with ``NotSupportedByShardwise`` (see deepspeed._surface).
"""
