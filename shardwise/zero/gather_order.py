"""The first pass of ZeRO-3 checks that every data-parallel rank gathers the same units in the same order.

ZeRO-3 gathers a module's parameters when the module is called. A module called on some ranks only (the
experts of a mixture-of-experts block that runs only the experts its tokens were routed to, as Mixtral's
and Qwen-MoE's blocks do in a Python loop) makes the ranks' collectives disagree: the gathers pair up
wrongly or wait forever. Until the first backward has finished, each gather of a unit and each gradient
reduction is preceded by a small all-reduce of what it is (MAX of ``(code, -code)`` over the data axis);
the first point where two ranks differ is then a check on every rank (everything before it matched), and
every rank raises an error naming the modules instead of hanging.
"""

from __future__ import annotations

import torch

from shardwise import comm

END = -1  # the end of the first backward pass


class GatherOrderCheck:
    def __init__(self, units, *, group) -> None:
        self.units, self.group = units, group
        self.active = comm.get_world_size(group) > 1

    def gather(self, unit) -> None:
        if self.active:
            self._check(unit.index)

    def reduce(self, unit) -> None:
        if self.active:
            self._check(len(self.units) + unit.index)

    def finish(self) -> None:
        """End of the first backward: one last check, then none."""
        if self.active:
            self._check(END)
            self.active = False

    def _check(self, code: int) -> None:
        t = torch.tensor([code, -code], dtype=torch.int64)
        comm.all_reduce(t, op=comm.ReduceOp.MAX, group=self.group)
        high, low = int(t[0]), -int(t[1])
        if high == code and low == code:
            return
        self.active = False
        other = high if high != code else low
        raise RuntimeError(
            f"ZeRO-3: the data-parallel ranks disagree on which parameters to gather in the first step: this "
            f"rank (global rank {comm.get_rank()}) {self._describe(code)}, another rank {self._describe(other)}. "
            "A module called on some ranks only (a mixture-of-experts block that runs only the experts its "
            "tokens were routed to) cannot be gathered module by module: make the block a leaf "
            "(shardwise.utils.set_z3_leaf_modules(model, [BlockClass]), or zero_optimization.leaf_module "
            "{\"classes\": [\"BlockClass\"]}) so that it gathers all its experts whichever run; docs/moe.md")

    def _describe(self, code: int) -> str:
        if code == END:
            return "has finished its backward pass"
        n = len(self.units)
        unit = self.units[code % n]
        what = "gathers" if code < n else "reduces the gradients of"
        names = sorted({name.rsplit(".", 1)[0] for name in unit.names})
        return f"{what} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
