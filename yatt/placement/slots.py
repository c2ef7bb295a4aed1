"""An engine that is released between the phases that use it (one interface, CPU and GPU).

Placement code asks a slot to ``wake`` its engine for a phase and to ``sleep`` it after. On GPU
that is vLLM's sleep mode (``VLLMEngine.sleep``/``wake_up``: weights to host memory, KV cache
freed); on CPU, where vLLM has no sleep mode, sleeping shuts the engine down and waking
rebuilds it. Building is collective (vLLM creates process groups over the world), so
:meth:`EngineSlot.build_now` lets every rank build its engines at one point; GPU sleep and
wake-up are local to the rank.

The weights after ``wake`` are the ones before ``sleep`` on GPU and the checkpoint's on CPU; a
rollout slot is always given the current policy weights after waking.
"""
from __future__ import annotations


class EngineSlot:
    """Holds at most one engine object built by ``build``.

    Args:
        build: ``() -> obj`` building the engine (collective); ``obj`` is a VLLMEngine or an
            object with an ``engine`` attribute holding one (a GenRMJudge).
        can_sleep: the engine supports sleep/wake-up (GPU); default: ask the built engine.
    """

    def __init__(self, build, can_sleep: bool | None = None) -> None:
        self._build, self._can_sleep = build, can_sleep
        self.obj = None
        self.asleep = False
        self.built_bytes = 0  # how much this process's resident memory grew at the last build

    @property
    def engine(self):
        return getattr(self.obj, "engine", self.obj)

    @property
    def awake(self) -> bool:
        """An engine is built and not asleep."""
        return self.obj is not None and not self.asleep

    @property
    def sleeps(self) -> bool:
        """True when releasing keeps the engine (GPU sleep); False: teardown and rebuild (CPU)."""
        if self._can_sleep is not None:
            return self._can_sleep
        return self.obj is not None and getattr(self.engine, "can_sleep", False)

    def build_now(self) -> None:
        """Build the engine if there is none (collective), leaving it awake."""
        if self.obj is None:
            import psutil

            proc = psutil.Process()
            before = proc.memory_info().rss
            self.obj, self.asleep = self._build(), False
            self.built_bytes = max(0, proc.memory_info().rss - before)

    def wake(self):
        """The engine, awake: woken from sleep, or built if there is none (then collective)."""
        if self.obj is None:
            self.build_now()
        elif self.asleep:
            self.engine.wake_up()
            self.asleep = False
        return self.obj

    def sleep(self) -> None:
        """Release the engine's memory: GPU sleep, or shutdown on CPU (collective there)."""
        if self.obj is None or self.asleep:
            return
        if self.sleeps:
            self.engine.sleep()
            self.asleep = True
        else:
            self.close()

    def close(self) -> None:
        """Shut the engine down for good (collective)."""
        if self.obj is not None:
            self.engine.shutdown()
        self.obj, self.asleep = None, False
