"""Run a command-line entry point's ``main(argv)`` on the test pool's ranks instead of under a
fresh ``torchrun``.

A torchrun run starts a launcher and one process per rank, each importing torch, shardlib and the
tool (4-6 s of CPU per process on the 2-core machine): 8-15 s of the suite per run. The pool's
workers have all of that imported and a process group already up, which the tools' ``init_mesh``
adopts. Each entry point keeps one torchrun test of its own (test_train, test_examples, test_cli);
the other runs of a test go through here.
"""

from __future__ import annotations

import contextlib
import io
import os

from shardlib.testing import run_on


def _main_on_rank(target: str, argv: list[str], cwd: str | None) -> tuple[int, str]:
    import importlib
    import runpy

    if target.endswith(".py"):  # a script: its functions, without running its __main__ block
        main = runpy.run_path(target, run_name="_shardlib_test_script")["main"]
    else:
        main = importlib.import_module(target).main
    here = os.getcwd()
    out = io.StringIO()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out):
            rc = main(list(argv))
    finally:
        os.chdir(here)
    return int(rc or 0), out.getvalue()


def run_main(nprocs: int, target: str, argv: list[str], cwd=None) -> list[tuple[int, str]]:
    """``main(argv)`` of module ``target`` (or of the script at path ``target``) on every rank of
    the pool of ``nprocs``, in folder ``cwd``; ``(exit status, stdout)`` by rank. An exception on
    a rank is raised as the pool's ``WorkerError``."""
    return run_on(nprocs, _main_on_rank, str(target), [str(a) for a in argv], None if cwd is None else str(cwd))


def stdout_of(nprocs: int, target: str, argv: list[str], cwd=None) -> str:
    """:func:`run_main`'s stdout of every rank, rank 0's first (as torchrun interleaves them),
    after asserting that every rank returned 0."""
    results = run_main(nprocs, target, argv, cwd)
    assert all(rc == 0 for rc, _ in results), [(rc, text[-2000:]) for rc, text in results]
    return "".join(text for _, text in results)


def _without_process_group(fn, args):
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return fn(*args)


def in_fresh_process(fn, *args):
    """``fn(*args)`` in a new process with no process group (a dry run makes its own fake
    worlds), forked from the pool's fork server: torch, shardlib and the preloaded modules come
    imported (a ``python`` subprocess took 8-12 s of the suite to import them). The process is
    stopped after, since its gloo group is gone."""
    from shardlib.mesh.launch import WorkerGroup

    group = WorkerGroup(1, timeout=float(os.environ.get("SHARDLIB_TEST_TIMEOUT", "120")))
    try:
        return group.run(_without_process_group, fn, args)[0]
    finally:
        group.close()
