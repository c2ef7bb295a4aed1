"""Library lines that need no action are dropped (yatt/logs.py), others still show, and
``log.level=all`` brings the dropped ones back; a job (conftest's shared demo run) prints YATT's lines and
real warnings only."""
import logging
import os
import re
import warnings

import pytest

from yatt import logs
from yatt.config import ConfigError, load_config

# Lines as the libraries print them in a CPU run (module or logger, warning class or None for a log line, message).
SEEN = [
    ("megatron.core.models.backends", UserWarning, "Apex is not installed. Falling back to Torch Norm"),
    ("megatron.core.models.gpt.gpt_layer_specs", UserWarning, "Apex is not installed. Falling back to Torch Norm"),
    ("megatron.core.optimizer", UserWarning,
     "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."),
    ("megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision", UserWarning, "Transformer Engine and Apex "
     "are not installed. Falling back to local implementations of multi_tensor_applier and multi_tensor_scale"),
    ("megatron.core.optimizer.clip_grads", UserWarning, "Transformer Engine and Apex are not installed. Falling back "
     "to local implementations of multi_tensor_applier, multi_tensor_l2norm, and multi_tensor_scale"),
    ("vllm.triton_utils.dispatcher", FutureWarning,
     "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead"),
    ("vllm.triton_utils.importing", None, "Triton is installed, but doesn't include CPU backend. Disabling Triton."),
    ("vllm.triton_utils.importing", None, "Triton is installed but 0 active driver(s) found (expected 1). "
     "Disabling Triton to prevent runtime errors."),
    ("vllm.triton_utils.importing", None,
     "Triton not installed or not compatible; certain GPU-related functions will not be available."),
    ("vllm.platforms.cpu", None, "Triton is not installed. triton-cpu is expected on x86 CPUs."),
    ("vllm.config.vllm", None, "Model Runner V2 requires Triton; using the V1 model runner instead."),
    ("vllm.config.vllm", None, "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup. This "
     "is equivalent to setting -cc.mode=none -cc.cudagraph_mode=none and --kernel_config.enable_jit_warmup=False"),
    ("vllm.config.vllm", None, "Inductor compilation was disabled by user settings, optimizations settings that are "
     "only active during inductor compilation will be ignored."),
    ("vllm.engine.arg_utils", None, "The global random seed is set to 7920. Since VLLM_ENABLE_V1_MULTIPROCESSING is "
     "set to False, this may affect the random state of the Python process that launched vLLM."),
    ("vllm.engine.arg_utils", None, "This model does not officially support disabling chunked prefill. Disabling "
     "this manually may cause the engine to crash or produce incorrect outputs."),
    ("vllm.platforms.cpu", None, "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'."),
    ("vllm.v1.worker.cpu_worker", None, "libtcmalloc is not found in LD_PRELOAD. For best performance, please follow "
     "the section `set LD_PRELOAD` in https://docs.vllm.ai/en/latest/getting_started/installation/cpu/ to setup "
     "required pre-loaded libraries."),
    ("vllm.v1.worker.cpu_worker", None, "libiomp is not found in LD_PRELOAD. For best performance, please follow "
     "the section `set LD_PRELOAD` in https://docs.vllm.ai/en/latest/getting_started/installation/cpu/ to setup "
     "required pre-loaded libraries."),
    ("vllm.v1.worker.cpu_worker", None,
     "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it."),
    ("vllm.model_executor.model_loader.reload.layerwise", None, "VocabParallelEmbedding: Failed to load weights"),
    ("vllm.triton_utils.dispatcher", None,  # from here: engines rebuilt in one process (GenRM recipe)
     "Kernel vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel is already registered. Overwriting."),
    ("vllm.platforms.interface", None, "Unknown vLLM environment variable detected: VLLM_DIST_IDENT"),
    ("vllm.v1.engine.input_processor", None, "Passing raw prompts to InputProcessor is deprecated and will be "
     "removed in the future. You should instead pass the outputs of Renderer.render_cmpl() or Renderer.render_chat()."),
]


class _Catch(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _shown(source: str, category: type[Warning] | None, text: str) -> bool:
    """Whether the line gets past this process's filters (a log line: at any logger level)."""
    if category is None:
        logger, catch = logging.getLogger(source), _Catch()
        logger.addHandler(catch)
        try:
            logger.handle(logger.makeRecord(source, logging.WARNING, "lib.py", 1, text, (), None))
        finally:
            logger.removeHandler(catch)
        return bool(catch.records)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logs.install()  # in front of "always", as at a job's start
        warnings.warn_explicit(text, category, "lib.py", 1, module=source, registry={})
    return bool(caught)


@pytest.fixture
def log_setup(monkeypatch):
    """``logs.setup`` in this process, its environment variables undone afterwards."""
    for key in ("TORCH_CPP_LOG_LEVEL", "VLLM_LOGGING_LEVEL"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    yield logs.setup
    logs.setup("quiet")  # the default, as an engine built later in this process installs it


def test_every_filter_drops_its_lines_and_lets_neighbours_through(log_setup):
    log_setup("quiet")
    for entry in logs.NOISE:
        if entry.source != "c10":
            assert any(re.match(entry.message, text, re.I) for _, _, text in SEEN), f"no seen line for {entry}"
    for source, category, text in SEEN:
        assert not _shown(source, category, text), text
        assert _shown(source, category, "Something else went wrong: " + text), text  # same source, other message
        assert _shown("yatt.trainer.actor", category, text), text  # same message, another source
    assert _shown("megatron.core.models.backends", DeprecationWarning, SEEN[0][2])  # another warning class
    assert _shown("vllm.platforms.interface", None, "Unknown vLLM environment variable detected: VLLM_LOGING_LEVEL")


def test_log_level_all_brings_them_back_and_quiet_drops_them_again(log_setup):
    log_setup("quiet")
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR" and os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    log_setup("all")
    assert all(_shown(*line) for line in SEEN)
    assert "TORCH_CPP_LOG_LEVEL" not in os.environ and logs.level() == "all"
    log_setup("quiet")
    assert not any(_shown(*line) for line in SEEN)
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR" and logs.level() == "quiet"


def test_a_variable_the_user_exported_is_kept(log_setup, monkeypatch):
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    for level in ("quiet", "all"):
        log_setup(level)
        assert os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO"


def test_an_unknown_level_is_refused(log_setup):
    with pytest.raises(ValueError, match="not one of"):
        log_setup("loud")
    with pytest.raises(ConfigError, match="log.level"):
        load_config(None, ["log.level=loud"])
    assert load_config(None, ["log.level=all"]).log.level == "all"


def test_native_runtime_names_the_allocator_and_openmp_runtime():
    maps = ("7f00-7f01 r-xp 00000000 08:01 11 /opt/lib/libtcmalloc_minimal.so.4.5.9\n"
            "7f02-7f03 r-xp 00000000 08:01 12 /venv/torch/lib/libgomp-a34b3233.so.1\n"
            "7f04-7f05 rw-p 00000000 00:00 0 \n")
    assert logs.native_runtime(maps) == ("memory allocator: tcmalloc (libtcmalloc_minimal.so.4.5.9); OpenMP: GNU "
                                         "(libgomp-a34b3233.so.1); for speed, install Debian's libtcmalloc-minimal4 "
                                         "(make setup does, as root): python -m yatt.launch then preloads it and "
                                         "Intel OpenMP (yatt/preload.py)")
    maps += "7f06-7f07 r-xp 00000000 08:01 13 /opt/intel/libiomp5.so\n"
    assert logs.native_runtime(maps).endswith("Intel (libiomp5.so)")
    assert logs.native_runtime("").startswith("memory allocator: glibc malloc; OpenMP: none loaded")
    assert logs.native_runtime().startswith("memory allocator: ")  # this process


# A tqdm bar's frame (rank 0's steps, rollout and judging bars), and the escape codes it moves the cursor with
_BAR = re.compile(r"\w+: +\d+%\|")
_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@pytest.mark.e2e
@pytest.mark.mpi
@pytest.mark.slow
def test_a_job_logs_yatt_lines_and_real_warnings_only(demo_run):
    """conftest's demo run went through tests/mpi/planted_warnings.py: two warnings that need
    action were planted after the job, its filters still in place."""
    log = demo_run.log  # both ranks' stdout and stderr (vLLM logs to stdout, as do the step lines)
    for entry in logs.NOISE:
        assert not re.search(entry.message, log, re.I), (entry, log[-4000:])
    for fixed in ("full scope is deprecated", "Loading safetensors checkpoint shards"):  # cuda_graph_scope=[]; bar off
        assert fixed not in log, log[-4000:]
    # one per rank
    assert log.count("UserWarning: planted by test_logs: a warning that needs action") == 2, log[-4000:]
    assert log.count("planted by test_logs: a vLLM warning that needs action") == 2, log[-4000:]
    assert log.count("memory allocator: ") == 1 and "[yatt r0 " in log, log[-4000:]
    frames = [f.strip() for line in _ESCAPE.sub("", log).splitlines() for f in line.split("\r")]
    foreign = [f for f in frames if f and not f.startswith("[yatt r") and not re.match(r"step +\d+ \|", f)
               and not _BAR.match(f) and "planted by test_logs" not in f]
    assert not foreign, foreign  # every other line is YATT's own
