"""What a traced forward leaves in the user's model, put back as it was.

Tracing runs the model's Python code. A forward that creates state lazily (a buffer
registered on the first call, a tensor cached in a dict, a counter incremented) would
otherwise leave fake tensors and moved counters behind: the real step that follows gets a
tensor with no data. :func:`kept_as_it_was` records each module's attributes, and the
contents of its dicts, lists and sets, and puts them back on exit.
"""

from __future__ import annotations

import contextlib

# Kept by nn.Module itself, or put back by the tracer (hooks, train/eval flags).
_SKIPPED = frozenset({"training"})


def _skipped(key: str) -> bool:
    return key in _SKIPPED or "hooks" in key


def _contents(value):
    """A shallow copy of a plain container's contents, or None for anything else."""
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    if isinstance(value, set):
        return set(value)
    return None


class Snapshot:
    """Each module's attributes as they are now: ``(module path, module, attributes,
    container contents)``."""

    def __init__(self, model):
        self.modules = []
        for path, m in model.named_modules(remove_duplicate=True):
            attrs = {k: v for k, v in vars(m).items() if not _skipped(k)}
            held = {k: c for k, v in attrs.items() if (c := _contents(v)) is not None}
            self.modules.append((path, m, attrs, held))

    def changed(self, ours=()) -> dict[str, set[str]]:
        """Module path -> the attributes its forward rebound or whose existing entries it
        changed. New attributes and new entries (a cache filled on the first call) are not
        changes: a second run of the forward finds them and computes the same. Nor are
        entries that now hold one of ``ours``: the caller's own doing (the tensors
        ``torch.func.functional_call`` swapped in, which it leaves in a module reachable
        under several names, as in ``nn.ModuleList([layer] * n)``)."""
        ours = {id(x) for x in ours}
        out: dict[str, set[str]] = {}
        for path, m, attrs, held in self.modules:
            now = vars(m)
            for k, v in attrs.items():
                if k not in now:
                    continue
                if now[k] is not v:
                    out.setdefault(path, set()).add(k)
                elif k in held and _entries_changed(held[k], v, ours):
                    out.setdefault(path, set()).add(k)
        return out

    def restore(self) -> None:
        for _path, m, attrs, held in self.modules:
            now = vars(m)
            for k in [k for k in now if k not in attrs and not _skipped(k)]:
                del now[k]
            for k, v in attrs.items():
                if now.get(k, _MISSING) is not v:
                    now[k] = v
                if k in held and not _same(held[k], v):
                    _put_back(v, held[k])


_MISSING = object()


def _entries_changed(before, container, ours=frozenset()) -> bool:
    if isinstance(container, dict):
        return any(k in container and container[k] is not v and id(container[k]) not in ours
                   for k, v in before.items())
    if isinstance(container, list):
        return any(a is not b and id(b) not in ours for a, b in zip(before, container))
    return False


def _same(before, container) -> bool:
    """Whether a container holds what it held, by identity (tensors have no plain ==)."""
    if isinstance(container, dict):
        return (len(before) == len(container)
                and all(k in container and container[k] is v for k, v in before.items()))
    if isinstance(container, list):
        return len(before) == len(container) and all(a is b for a, b in zip(before, container))
    return before == container


def _put_back(container, contents) -> None:
    if isinstance(container, list):
        container[:] = contents
    else:
        container.clear()
        container.update(contents)


# nn.Module's own tables: parameters and buffers are the step's state already.
_MODULE_OWN = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


class HeldTensors:
    """Tensors modules keep in plain attributes, and in the lists, tuples and dicts held
    there (a hook's ``self.activation = o.detach()``, an attention map kept for
    visualisation, a queue): state a real step finds from the step before, live until the
    forward rebinds them. Parameters and buffers are not among them."""

    _DEPTH = 4  # containers within containers followed

    def __init__(self, model):
        self.model = model
        self._undo: list = []  # (module, attribute, value) or (container, its contents)
        self.left: list = []   # (name, fake tensor): what a traced step left (restore)

    def tensors(self) -> list:
        """``(name, tensor)`` for each tensor held (a tensor held twice, once)."""
        found: list = []
        self._walk_modules(lambda name, t: found.append((name, t)))  # None: each kept
        return found

    def swap(self, copy_of) -> list:
        """Puts ``copy_of(tensor)`` in place of each tensor held, where it is not None (lists
        and dicts changed in place, tuples rebuilt); :meth:`restore` puts them back.
        Returns ``(name, copy)`` for each."""
        made: list = []

        def visit(name, t):
            c = copy_of(t)
            if c is not None:
                made.append((name, c))
            return c

        self._walk_modules(visit)
        return made

    def restore(self, made_in_step=None) -> None:
        """Puts back what :meth:`swap` replaced. ``made_in_step(fake tensor)``: whether a
        traced step made it; those the step left in the modules then (in attributes or
        entries it added) are kept in ``left``."""
        from torch._subclasses.fake_tensor import is_fake

        for entry in reversed(self._undo):
            if len(entry) == 3:
                vars(entry[0])[entry[1]] = entry[2]
            else:
                _put_back(*entry)
        self._undo = []
        if made_in_step is not None:
            self.left = [(name, t) for name, t in self.tensors()
                         if is_fake(t) and not t._is_zerotensor() and made_in_step(t)]

    def stand_in(self) -> None:
        """Puts a meta tensor in place of each tensor in ``left``, its storage as large and
        shared as theirs: what the step after the traced one finds there. Put back as the
        model's other attributes are (:func:`kept_as_it_was`)."""
        import torch

        left = {id(t) for _, t in self.left}
        bases: dict[int, object] = {}  # storage key -> a meta one of its bytes
        HeldTensors(self.model).swap(
            lambda t: storage_alias(bases, t, "meta") if id(t) in left else None)
        self.left = []

    def _walk_modules(self, visit) -> None:
        memo: dict[int, object] = {}  # id(tensor or container) -> what stands for it
        for path, m in self.model.named_modules():
            for k, v in list(vars(m).items()):
                if _skipped(k) or k in _MODULE_OWN:
                    continue
                new = self._walk(v, f"{path}.{k}" if path else k, visit, memo, self._DEPTH)
                if new is not v:
                    self._undo.append((m, k, v))
                    vars(m)[k] = new

    def _walk(self, value, name, visit, memo, depth):
        """`value` with each tensor in it replaced by what `visit` returns for it (None:
        kept)."""
        import torch

        if id(value) in memo:  # held twice: one copy stands for it in both places
            return memo[id(value)]
        if isinstance(value, torch.Tensor):
            new = visit(name, value)
            memo[id(value)] = value if new is None else new
            return memo[id(value)]
        if depth == 0 or not isinstance(value, (list, tuple, dict)):
            return value
        memo[id(value)] = value  # a container within itself
        items = value.items() if isinstance(value, dict) else enumerate(value)
        new = {k: self._walk(v, f"{name}[{k!r}]", visit, memo, depth - 1)
               for k, v in items}
        old = dict(value.items() if isinstance(value, dict) else enumerate(value))
        if all(new[k] is v for k, v in old.items()):
            return value
        if isinstance(value, tuple):
            try:  # a named tuple takes its fields as arguments
                memo[id(value)] = (type(value)(*new.values()) if hasattr(value, "_fields")
                                   else tuple(new.values()))
            except TypeError:
                pass
            return memo[id(value)]
        self._undo.append((value, _contents(value)))
        if isinstance(value, list):
            value[:] = list(new.values())
        else:
            value.update(new)
        return value


def storage_alias(bases: dict, t, device: str):
    """A tensor on `device` with `t`'s shape, strides and offset into a storage as large as
    `t`'s, one per storage of the real ones (`bases`: storage key -> that storage's bytes),
    so that copies of views of one tensor share their bytes as the views do."""
    import torch

    s = t.untyped_storage()
    if s._cdata not in bases:
        bases[s._cdata] = torch.empty(s.nbytes(), dtype=torch.uint8, device=device)
    try:
        return bases[s._cdata].view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
    except RuntimeError:  # bytes its dtype does not divide: a storage of its own
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


def _function_caches() -> list:
    """Every ``functools.lru_cache`` / ``functools.cache`` wrapper alive."""
    import functools
    import gc

    kind = functools._lru_cache_wrapper
    # type(), not isinstance(): that reads __class__, which proxies answer with side effects.
    return [o for o in gc.get_objects() if type(o) is kind]


def _holds_fake_tensor(cache, depth: int = 6) -> bool:
    """Whether a cache's entries (reached through the objects it references, not through
    functions, classes or modules) hold a fake tensor."""
    import gc
    import types

    from torch._subclasses.fake_tensor import FakeTensor

    opaque = (type, types.ModuleType, types.FunctionType, types.MethodType,
              types.BuiltinFunctionType)
    seen, stack = set(), [(r, 1) for r in gc.get_referents(cache)]
    while stack:
        obj, d = stack.pop()
        if isinstance(obj, FakeTensor):
            return True
        if d >= depth or id(obj) in seen or isinstance(obj, opaque):
            continue
        seen.add(id(obj))
        stack.extend((r, d + 1) for r in gc.get_referents(obj))
    return False


@contextlib.contextmanager
def function_caches_kept():
    """Clears, after the body, each ``functools.lru_cache`` that holds a fake tensor. Models
    cache tensors outside themselves (BEiT's and Data2Vec-Vision's relative position index,
    DINOv3's patch coordinates, a user's sin/cos table): the traced forward filled the
    cache with a fake tensor, and every real forward after it in the process computed on
    fake tensors. Caches without fake tensors are left alone: some run a registration
    once. The caches are looked for (a scan of the heap, about 0.1 s with transformers
    loaded) only where a fake tensor made in the body outlives it; after a plain trace none
    does."""
    import weakref

    from torch._subclasses.fake_tensor import FakeTensor

    made = weakref.WeakSet()
    new = FakeTensor.__dict__["__new__"]

    def note(cls, *args, **kwargs):
        t = new.__func__(cls, *args, **kwargs)
        made.add(t)
        return t

    FakeTensor.__new__ = staticmethod(note)
    try:
        yield
    finally:
        FakeTensor.__new__ = new
        if len(made):
            for c in _function_caches():
                if c.cache_info().currsize and _holds_fake_tensor(c):
                    c.cache_clear()


@contextlib.contextmanager
def kept_as_it_was(model):
    """Runs the body, then puts every module's attributes and containers back: what the
    body created goes, what it rebound or changed comes back. Yields the snapshot, whose
    ``changed()`` says (before the restore) what the body changed."""
    snap = Snapshot(model)
    try:
        yield snap
    finally:
        snap.restore()
