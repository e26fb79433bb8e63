"""``torch.compile`` backend whose forward/backward partition follows a checkpoint plan.

Dynamo records, on every node of the graph it captures, the stack of modules that made it
(``nn_module_stack``); AOTAutograd keeps that on the joint forward+backward graph. Before
partitioning we tag the forward nodes of each planned module, as ``torch.utils.checkpoint``
does under compile:

- policy ``full``: every node ``MUST_RECOMPUTE``;
- policy ``save-compute``: matmul/convolution/attention ``MUST_SAVE``, the rest
  ``MUST_RECOMPUTE``;

random ops (dropout) are never tagged for recompute: recomputing them would draw new
masks. Each module gets its own ``ac_graph_id``, so the boundary between two adjacent
recomputed modules stays saved. PyTorch's min-cut partitioner then honours the tags and
decides the rest itself.

``compiler="aot_eager"`` runs the partitioned graphs as they are (exact, for testing and
debugging); ``"inductor"`` tags the joint graph through Inductor's ``joint_custom_pre_pass``
hook and compiles as usual.
"""

from __future__ import annotations

import re

from ..errors import PlannerError


def _module_path(fqn: str) -> str:
    """Dynamo's "L['self'].layers[0].mlp" or "L['self'].layers.0.mlp" -> "layers.0.mlp"."""
    path = re.sub(r"^L\['[^']*'\]\.?", "", fqn)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return path.lstrip(".")


def tag_graph(graph, policies: dict[str, str]) -> int:
    """Tag the forward nodes of ``graph`` (an FX joint graph) that belong to planned
    modules; returns how many were tagged for recompute."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    from .cost import is_compute_bound

    order = {m: k for k, m in enumerate(policies)}
    tagged = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.meta.get("partitioner_tag") == "is_backward":
            continue
        stack = node.meta.get("nn_module_stack") or {}
        owner = None
        for fqn, _cls in stack.values():  # outermost first: the planned module that holds it
            path = _module_path(fqn)
            if path in policies:
                owner = path
                break
        if owner is None:
            continue
        target = node.target
        tags = getattr(target, "tags", ())
        name = (f"aten.{target.overloadpacket.__name__}"
                if isinstance(target, torch._ops.OpOverload) else str(target))
        if torch.Tag.nondeterministic_seeded in tags:
            policy = CheckpointPolicy.MUST_SAVE  # a new mask on recompute would be wrong
        elif policies[owner] == "save-compute" and is_compute_bound(name):
            policy = CheckpointPolicy.MUST_SAVE
        else:
            policy = CheckpointPolicy.MUST_RECOMPUTE
            tagged += 1
        node.meta["recompute"] = policy
        node.meta["ac_graph_id"] = order[owner]
    return tagged


def _saved_bytes(fw, num_fwd_outputs: int) -> int:
    """Bytes of the forward graph's outputs kept for backward (beyond the user outputs)."""
    import torch

    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    total = 0
    for n in out.args[0][num_fwd_outputs:]:
        v = n.meta.get("val") if hasattr(n, "meta") else None
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


class CompileBackend:
    """A ``torch.compile`` backend applying ``plan``; see :func:`compile_backend`."""

    def __init__(self, plan, compiler: str = "aot_eager"):
        if compiler not in ("aot_eager", "inductor"):
            raise PlannerError(f"compiler={compiler!r}: use 'aot_eager' or 'inductor'")
        self.plan = plan
        self.compiler = compiler
        self.tagged = 0          # forward nodes tagged for recompute, over all graphs
        self.saved_bytes = 0     # bytes the forward graphs save for backward (aot_eager)

    def _tag(self, graph):
        self.tagged += tag_graph(graph, self.plan.policies)

    def __call__(self, gm, example_inputs):
        if self.compiler == "inductor":
            import torch._inductor.config as inductor_config
            from torch._inductor.compile_fx import compile_fx

            with inductor_config.patch(joint_custom_pre_pass=self._tag):
                return compile_fx(gm, example_inputs)
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        def partition(joint, joint_inputs, **kwargs):
            self._tag(joint.graph)
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
            self.saved_bytes += _saved_bytes(fw, kwargs.get("num_fwd_outputs", 0))
            return fw, bw

        def nop(g, _inputs):
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=nop, bw_compiler=nop,
                                     partition_fn=partition)


def compile_backend(budget=None, *, plan=None, model=None, inputs=None,
                    compiler: str = "aot_eager", **plan_kwargs) -> CompileBackend:
    """A backend for ``torch.compile(model, backend=...)`` that checkpoints as planned.

    Give either ``plan`` (from ``pymemplan.plan`` / ``MemoryTrace.plan``), or ``budget``
    with the ``model`` and example ``inputs`` to plan for (``pymemplan.plan`` keywords,
    e.g. ``loss_fn``, ``optimizer``, ``device``, go in ``plan_kwargs``)."""
    if plan is None:
        if budget is None or model is None or inputs is None:
            raise PlannerError(
                "compile_backend needs a plan to follow: pass plan=pymemplan.plan(model, "
                "inputs, budget=...), or budget=... together with model=... and inputs=... "
                "(the backend only sees Dynamo's graph, not the model, so it cannot trace "
                "the step itself)")
        from . import plan as make

        plan = make(model, inputs, budget, **plan_kwargs)
    return CompileBackend(plan, compiler)
