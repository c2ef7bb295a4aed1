"""A YATT job as ``python -m yatt.launch`` runs it, then two warnings that need action, planted
after the job while its log filters are still installed: a Python warning and a vLLM logger's
warning (a logger whose other lines are filtered). Installs nothing itself.

``python tests/mpi/planted_warnings.py --config FILE [key=value ...]``; exits with the job's code.
"""
from yatt.preload import restart_with_preload

restart_with_preload()  # as python -m yatt.launch does

import logging  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

from yatt.launch import exit_process, main  # noqa: E402

code = main(sys.argv[1:])
warnings.warn("planted by test_logs: a warning that needs action")
logging.getLogger("vllm.v1.worker.cpu_worker").warning("planted by test_logs: a vLLM warning that needs action")
exit_process(code)
