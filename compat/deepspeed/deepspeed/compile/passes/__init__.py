"""DeepCompile's graph passes (``deepspeed.compile.passes``): each pass module declares its registry name
(``NAME``) and its :class:`~deepspeed.compile.passes.contract.PassContract`."""
