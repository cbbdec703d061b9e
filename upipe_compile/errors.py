"""The one exception users see from upipe-compile."""


class UnsupportedAttention(RuntimeError):
    """An attention call (or an option) that UPipe cannot run correctly.

    Raised at compile time when the graph shows the problem, or at run time when only the
    values show it (for example shards of different lengths on different ranks). The message
    names the model's source line where one is known, the reason, and the fix.
    """


def display_path(path: str) -> str:
    """``path`` as a message names it, without the machine's folders: from the longest
    ``sys.path`` entry or upipe folder holding it (``transformers/models/jetmoe/modeling_jetmoe.py``,
    ``upipe_compile/passes/graph_utils.py``), else relative to the working directory, else as
    given. Messages end up in logs and committed result tables, where a venv's path means nothing."""
    import os

    if not os.path.isabs(path):  # already relative, or "<string>", "<eval_with_key>.3"
        return path
    imported = import_path(path)
    if imported is not None:
        return imported
    absolute = os.path.realpath(path)
    cwd = os.path.realpath(os.getcwd())
    if absolute.startswith(cwd + os.sep):
        return os.path.relpath(absolute, cwd)
    return path


def import_path(path: str):
    """An absolute ``path`` from the longest ``sys.path`` entry or upipe folder holding it (the
    path its module is imported by: ``transformers/models/llama/modeling_llama.py`` from
    site-packages or from a checkout's ``src/``); None where none holds it, or for a relative path."""
    import os

    if not os.path.isabs(path):
        return None
    absolute = os.path.realpath(path)
    roots = [(root, prefix) for root, prefix in _import_roots() if absolute.startswith(root + os.sep)]
    if not roots:
        return None
    root, prefix = max(roots, key=lambda entry: len(entry[0]))
    return os.path.join(prefix, os.path.relpath(absolute, root))


_roots_cache: tuple = (None, [])


def _import_roots() -> list[tuple[str, str]]:
    """(folder, the import path it stands for): each ``sys.path`` folder (""), and the folders
    of upipe's packages, which a checkout maps in from beside ``upipe_compile/``
    (``passes/`` is ``upipe_compile/passes``). The filesystem root and the working directory
    (``""`` on ``sys.path``) are left to the caller: they would hold everything. Made again only
    when sys.path, the loaded modules or the working directory changed (a message may name many files)."""
    import os
    import sys

    global _roots_cache
    cwd = os.path.realpath(os.getcwd())
    key = (tuple(sys.path), len(sys.modules), cwd)
    if _roots_cache[0] != key:
        _roots_cache = (key, _find_import_roots(cwd))
    return _roots_cache[1]


def _find_import_roots(cwd: str) -> list[tuple[str, str]]:
    import os
    import sys

    roots = [(os.path.realpath(entry), "") for entry in sys.path if entry and os.path.isdir(entry)]
    for name, module in list(sys.modules.items()):
        if name.split(".", 1)[0] == "upipe_compile" and getattr(module, "__path__", None):
            roots += [(os.path.realpath(folder), name.replace(".", os.sep)) for folder in module.__path__]
    return [(root, prefix) for root, prefix in roots if root not in (os.sep, cwd)]
