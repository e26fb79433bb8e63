"""Eager apply: wrap the planned modules' forwards in ``torch.utils.checkpoint``.

The model object is changed in place and returned, so parameters, ``state_dict`` and the
call signature stay exactly as they were: each planned module gets an instance attribute
``forward`` that calls the class's forward through non-reentrant checkpointing
(``use_reentrant=False``, RNG state preserved so dropout masks are the same on
recompute). Segments of an ``nn.Sequential`` ("path[first:last]") are applied by giving
the Sequential a forward that runs those children under one checkpoint. A unit planned
"save-compute" gets a selective-checkpoint policy
(``create_selective_checkpoint_contexts``) that keeps the outputs of matmuls,
convolutions and attention and recomputes the rest. :func:`remove` deletes those
attributes. Applying the same plan again does nothing; another plan on a model that has
one applied is an error (the two would nest: a plan nobody predicted).

Recomputing a forward would update BatchNorm's running statistics a second time; the
wrapper puts the running buffers of the BatchNorm layers the unit runs (those in training
mode: its own, and any it calls without owning them, passed as an argument or held by
reference) back after the recompute, so they move once per step, as without
checkpointing. Other
state a forward changes (spectral norm's power iteration, an observer's range, a step
counter kept in a buffer) is not restored: its recompute would compute with state the
first run has already moved, and gradients would silently differ. The planner leaves
such modules out (``cost.forward_facts``), and a unit applied by hand whose forward
changes a buffer in place is an error at that forward.

A key/value cache is the other state a forward mutates: a recomputed attention layer
would append its keys to it a second time, and backward would fail on mismatched
shapes. Every Hugging Face config in the model has its ``use_cache`` turned off while a
plan is applied (as transformers' own gradient checkpointing does; training never reads
the cache): the model's, and those of its submodules (T5's decoder has a copy of its
own; a model may wrap one). :func:`remove` restores them; a cache passed to a
checkpointed module anyway is a clear error at the forward, not a shape error deep in
backward.

Keyword arguments reach the module, not ``checkpoint``: a module keyword named as one
of checkpoint's own (``debug``, ``preserve_rng_state``, ``early_stop``...) is bound to
the module's forward before checkpoint is called.
"""

from __future__ import annotations

import contextlib
import functools
import re

_MARK = "_pymemplan_checkpointed"
_USE_CACHE = "_pymemplan_use_cache"  # a Hugging Face config's use_cache before apply()
_OWN_FORWARD = "_pymemplan_own_forward"  # a forward set on the instance before apply()
_APPLIED = "_pymemplan_applied"  # on the model: the units apply() checkpointed, by policy


_BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _bn_modules(modules):
    import torch

    return [m for top in modules for m in top.modules()
            if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats]


def restored_buffers(module) -> set[str]:
    """Names of ``module``'s own buffers that a checkpointed forward puts back after its
    recompute: BatchNorm's running statistics."""
    import torch

    bn = isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.track_running_stats
    return set(_BN_BUFFERS) if bn else set()


def _buffer_versions(owners) -> list:
    """(module, buffer name, tensor, version) of every buffer under ``owners`` that is not
    put back after a recompute."""
    out = []
    for top in owners:
        for m in top.modules():
            keep = restored_buffers(m)
            out.extend((m, n, b, b._version) for n, b in m._buffers.items()
                       if b is not None and n not in keep)
    return out


def _refuse_changed_state(owners, before) -> None:
    # In place only: a buffer replaced by a new tensor is most often a cache rebuilt the
    # same way each time (rotary tables grown for a longer sequence), which a recompute
    # rebuilds alike; plans leave out modules seen to replace buffers when traced too.
    from ..errors import PlannerError

    owned = {id(m) for top in owners for m in top.modules()}
    for m, name, b, version in before:
        if m._buffers.get(name) is b and b._version != version:
            whose = (f"of its {type(m).__name__}" if id(m) in owned else
                     f"of a {type(m).__name__} it calls without owning it")
            raise PlannerError(
                f"the checkpointed module {type(owners[0]).__name__} changes the buffer "
                f"'{name}' {whose} in its forward: the recompute in "
                f"backward would compute with the state the first run left and change it "
                f"again, so gradients would silently differ. Do not checkpoint it (plans of "
                f"pymemplan.plan leave such modules out)")


@contextlib.contextmanager
def _modules_called(owners):
    """The modules called in the block that are not under ``owners`` (passed to a unit as
    an argument, held by reference): ``(running BatchNorms, buffer versions)``, filled in
    as they are called. Their state is the unit's as its own modules' is: a recompute runs
    them again."""
    import torch

    owned = {id(m) for top in owners for m in top.modules()}
    seen: set[int] = set()
    bns: list = []
    versions: list = []

    def hook(m, _args):
        if id(m) in owned or id(m) in seen:
            return
        seen.add(id(m))
        keep = restored_buffers(m)
        if keep and m.training:
            bns.append(m)
        versions.extend((m, n, b, b._version) for n, b in m._buffers.items()
                        if b is not None and n not in keep)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield bns, versions
    finally:
        handle.remove()


def _save_compute_policy(ctx, op, *args, **kwargs):
    """Selective checkpointing: keep what matmuls, convolutions and attention made."""
    from torch.utils.checkpoint import CheckpointPolicy

    from .cost import is_compute_bound

    name = f"aten.{op.overloadpacket.__name__}" if hasattr(op, "overloadpacket") else str(op)
    return (CheckpointPolicy.MUST_SAVE if is_compute_bound(name)
            else CheckpointPolicy.PREFER_RECOMPUTE)


def _checkpointed_forward(module, policy, *args, **kwargs):
    # A forward set on the instance (accelerate's hooks, a user's patch) is the one the
    # trace ran and the plan was made for.
    forward = module.__dict__.get(_OWN_FORWARD) or type(module).forward.__get__(module)
    return _run_checkpointed(forward, [module], policy, *args, **kwargs)


def _segmented_forward(seq, segments, input):
    """nn.Sequential.forward with the planned runs of children under checkpoint;
    ``segments``: index of first child -> (index of last child, policy)."""
    kids = list(seq._modules.values())

    def run_range(i, j):
        def fn(x):
            for m in kids[i:j + 1]:
                x = m(x)
            return x
        return fn

    i = 0
    while i < len(kids):
        if i in segments:
            j, policy = segments[i]
            input = _run_checkpointed(run_range(i, j), kids[i:j + 1], policy, input)
            i = j + 1
        else:
            input = kids[i](input)
            i += 1
    return input


def _run_checkpointed(forward, owners, policy, *args, **kwargs):
    import torch
    from torch.utils.checkpoint import checkpoint

    # Each BatchNorm by its own mode: one in training mode inside a unit in eval mode
    # still moves its statistics.
    buffers = [getattr(m, b) for m in _bn_modules(owners) if m.training
               for b in _BN_BUFFERS if getattr(m, b, None) is not None]
    calls = [0]
    # The arguments as they are now: checkpoint keeps the objects, and a caller may change a
    # list after the call (DenseNet appends each layer's output to the list it passes), so
    # the recompute gets copies of the containers, with the same tensors in them.
    first_args, first_kwargs = _snapshot(args), _snapshot(kwargs)

    def run(*a):
        calls[0] += 1
        if calls[0] == 1:
            before = _buffer_versions(owners)
            with _modules_called(owners) as (bns, versions):
                out = forward(*a, **kwargs)
            _refuse_changed_state(owners, before + versions)
            # BatchNorms it ran without owning them (passed as an argument): put back too.
            buffers.extend(getattr(m, b) for m in bns for b in _BN_BUFFERS
                           if getattr(m, b, None) is not None)
            return out
        a, k = first_args, first_kwargs
        if not buffers:
            return forward(*a, **k)
        # The recompute: put BatchNorm's running statistics back as the first run left
        # them. The copies are made outside any dispatch mode: a selective-checkpoint
        # policy would otherwise take them for ops of the recomputed region.
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes(), torch.no_grad():
            kept = [b.clone() for b in buffers]
        try:
            return forward(*a, **k)
        finally:
            with _disable_current_modes(), torch.no_grad():
                for b, v in zip(buffers, kept):
                    b.copy_(v)

    if not torch.is_grad_enabled():  # inference: nothing would be saved anyway
        return forward(*args, **kwargs)
    _refuse_caches(owners, args, kwargs)
    extra = {}
    if policy == "save-compute":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts,
                                                _save_compute_policy)
    # The module's keywords stay in `run`'s closure: passed to checkpoint, those named as
    # its own options would be taken by it.
    return checkpoint(run, *args, use_reentrant=False, **extra)


def _snapshot(v):
    """``v`` with its lists, dicts and tuples copied (recursively), tensors and other
    objects shared."""
    if type(v) is list:
        return [_snapshot(x) for x in v]
    if type(v) is tuple:
        return tuple(_snapshot(x) for x in v)
    if type(v) is dict:
        return {key: _snapshot(x) for key, x in v.items()}
    return v


def _is_cache(v) -> bool:
    # transformers.cache_utils.Cache, recognised by its interface so that transformers
    # need not be imported (nor installed).
    return (not isinstance(v, (list, tuple, dict)) and callable(getattr(v, "update", None))
            and callable(getattr(v, "get_seq_length", None)))


def _refuse_caches(owners, args, kwargs):
    from ..errors import PlannerError

    for name, v in [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items()):
        if v is not None and _is_cache(v):
            raise PlannerError(
                f"a key/value cache ({type(v).__name__}, {name}) is passed to the checkpointed "
                f"module {type(owners[0]).__name__}: its recompute in backward would append "
                f"to the cache a second time. Train with use_cache=False (the plan turns "
                f"model.config.use_cache off; a call passing use_cache=True overrides it)")


_SEGMENT = re.compile(r"^(.*)\[([^\[\]:]+):([^\[\]:]+)\]$")


def apply(model, modules):
    """Checkpoint each unit in ``modules`` (a list, or a dict unit -> policy, "full" or
    "save-compute"); a unit is a module path, or ``"path[first:last]"``: the children
    ``first`` to ``last`` (names, inclusive) of the ``nn.Sequential`` at ``path``.
    Returns ``model`` itself."""
    import torch

    from ..errors import PlannerError

    if not isinstance(modules, dict):
        modules = {path: "full" for path in modules}
    modules = dict(modules)
    # Applying a plan again is a no-op (Sequential runs included); another plan on top of
    # one applied would nest the two, a plan nobody predicted: an error.
    applied = model.__dict__.get(_APPLIED)
    if applied is not None or checkpointed_modules(model):
        if applied == modules:
            return model
        raise PlannerError(
            f"the model already has a plan applied (checkpointing "
            f"{', '.join(sorted(applied or checkpointed_modules(model))[:4])}"
            f"{', ...' if len(applied or checkpointed_modules(model)) > 4 else ''}): call "
            f"plan.remove(model) before applying another one")
    segments: dict[str, dict] = {}
    for path, policy in modules.items():
        if policy not in ("full", "save-compute"):
            raise PlannerError(f"unknown checkpoint policy {policy!r} for '{path}': use "
                               f"'full' or 'save-compute'")
        seg = _SEGMENT.match(path)
        if seg is not None:
            segments.setdefault(seg.group(1), {})[(seg.group(2), seg.group(3))] = policy
            continue
        m = _get(model, path)
        if getattr(m, _MARK, False):
            continue
        own = m.__dict__.get("forward")
        if own is None and type(m).forward is torch.nn.Module.forward:
            raise PlannerError(f"module '{path}' ({type(m).__name__}) has no forward to "
                               f"checkpoint; plan with model=... so containers are left out")
        if own is not None:
            object.__setattr__(m, _OWN_FORWARD, own)
        object.__setattr__(m, "forward", functools.partial(_checkpointed_forward, m, policy))
        object.__setattr__(m, _MARK, True)
    for path, runs in segments.items():
        seq = _get(model, path)
        if (type(seq).forward is not torch.nn.Sequential.forward or getattr(seq, _MARK, False)
                or "forward" in seq.__dict__):
            raise PlannerError(f"the plan checkpoints runs of children of '{path}', which is "
                               f"not a plain nn.Sequential here (or is checkpointed whole, or "
                               f"its forward was replaced on the instance); apply a plan to "
                               f"the model it was made for")
        names = list(seq._modules)
        by_start = {}
        for (first, last), policy in runs.items():
            if first not in names or last not in names:
                raise PlannerError(f"'{path}' has no children '{first}'..'{last}'; apply a "
                                   f"plan to the model it was made for")
            by_start[names.index(first)] = (names.index(last), policy)
        object.__setattr__(seq, "forward", functools.partial(_segmented_forward, seq, by_start))
        object.__setattr__(seq, _MARK, True)
    if modules and _USE_CACHE not in model.__dict__:
        turned_off = cache_configs(model)
        for cfg in turned_off:
            cfg.use_cache = False
        object.__setattr__(model, _USE_CACHE, turned_off)
    if modules:
        object.__setattr__(model, _APPLIED, modules)
    return model


def cache_configs(model) -> list:
    """The Hugging Face configs in ``model`` (its own and its submodules', each once) whose
    ``use_cache`` is on: :func:`apply` turns them off."""
    out, seen = [], set()
    for m in model.modules():
        cfg = m.__dict__.get("config")
        if cfg is not None and id(cfg) not in seen and getattr(cfg, "use_cache", None) is True:
            seen.add(id(cfg))
            out.append(cfg)
    return out


@contextlib.contextmanager
def caches_off(model):
    """``use_cache`` off in every Hugging Face config of ``model`` for the block, as a plan
    applied has it (the step then keeps other tensors: GPT-NeoX 7.5% more)."""
    configs = cache_configs(model)
    for cfg in configs:
        cfg.use_cache = False
    try:
        yield configs
    finally:
        for cfg in configs:
            cfg.use_cache = True


def _get(model, path):
    from ..errors import PlannerError

    try:
        return model.get_submodule(path)
    except AttributeError as e:
        raise PlannerError(f"the plan checkpoints module '{path}', which this model does "
                           f"not have ({e}); apply a plan to the model it was made for") from None


def remove(model):
    """Undo :func:`apply` on every module of ``model``; returns ``model``."""
    for m in model.modules():
        if m.__dict__.pop(_MARK, False):
            m.__dict__.pop("forward", None)
            own = m.__dict__.pop(_OWN_FORWARD, None)
            if own is not None:
                object.__setattr__(m, "forward", own)
    for cfg in model.__dict__.pop(_USE_CACHE, None) or ():
        cfg.use_cache = True
    model.__dict__.pop(_APPLIED, None)
    return model


def checkpointed_modules(model) -> list[str]:
    """Modules whose forward was replaced (whole, or a Sequential running segments)."""
    return [name for name, m in model.named_modules() if m.__dict__.get(_MARK, False)]


def unit_modules(model, unit: str) -> list:
    """The modules a plan unit covers: the module itself, or the Sequential's run."""
    seg = _SEGMENT.match(unit)
    if seg is None:
        return [_get(model, unit)]
    seq = _get(model, seg.group(1))
    names = list(seq._modules)
    i, j = names.index(seg.group(2)), names.index(seg.group(3))
    return [seq._modules[n] for n in names[i:j + 1]]
