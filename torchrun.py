"""torchrun.py: torchrun (torch.distributed.run, the same flags) that leaves the ranks' own one-line errors as what
a failure shows, and exits with the code of the rank that failed first.

    python torchrun.py --standalone --nproc_per_node=8 train_c4.py --depth 48 --seed 123 --parallel fsdp

torchrun follows any rank's non-zero exit (a refused setting, a stop's 75, a killed rank) with a ChildFailedError
traceback and a table of every rank, and exits 1 whatever the ranks said; each rank of train_c4.py has already
said why in one line. A signal ends it as a shell reports one: 128 + N. Its agent's files (each rank's error file)
go to a temporary folder removed when it ends, unless --log-dir (or PET_LOG_DIR) names one: torchrun's own default
is a new torchelastic_* folder in TMPDIR at every start, never removed.
"""
import contextlib
import logging
import sys
import tempfile

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str]) -> int:
    # torchrun's agent logs each rank's exit, every SIGTERM it forwards and its OMP_NUM_THREADS banner: the ranks'
    # own lines say more
    for name in ("torch.distributed.run", "torch.distributed.elastic"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    args = parse_args(argv)
    with contextlib.ExitStack() as cleanup:
        if args.log_dir is None:
            args.log_dir = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="torchrun."))
        return launched(args)


def launched(args) -> int:
    """torchrun's run(args), its failure as the exit code of the rank that failed first."""
    try:
        run(args)
    except ChildFailedError as error:
        code = error.get_first_failure()[1].exitcode
        return code if code >= 0 else 128 - code
    except SignalException as stopped:          # the ranks got the signal too, and checkpoint before they exit
        return 128 + stopped.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
