"""Optional work beside the updates: the per-GEMM diagnostics probe and the profiler trace."""

import os
import time

import jax

__all__ = ["Profiler", "make_probe", "run_probe"]


def make_probe(config, model):
    """The jitted diagnostics probe (its diag/<kind>/<gemm>/<quantity> metric lines, docs/diagnostics.md)
    or None when diagnostics.every is 0.

    It sees the params before the update and the update's first micro-batch (rows 0, A, 2A, ... under
    gradient accumulation by A, as training.state splits them), with that micro-batch's quantization key.
    """
    if config.diagnostics.every <= 0:
        return None
    from fp4jax.gemm_errors import make_training_probe  # only runs that ask for it import it

    probe = make_training_probe(model, model.recipe)  # the Recipe it trains with (fp8_scaling applied)
    accum = config.grad_accum

    def first_micro_batch(params, batch, key):
        batch = jax.tree.map(lambda x: x[::accum], batch) if accum > 1 else batch
        return probe(params, batch, jax.random.fold_in(key, 0) if accum > 1 else key)

    return jax.jit(first_micro_batch)


def run_probe(probe, state, batch, quant_key, step: int) -> dict:
    """The probe's scalars for update `step` (before it is applied) plus diag_time_s."""
    t0 = time.perf_counter()
    values = jax.device_get(probe(state.params, batch, jax.random.fold_in(quant_key, step - 1)))
    record = {k: float(v) for k, v in values.items()}
    record["diag_time_s"] = time.perf_counter() - t0
    return record


class Profiler:
    """A jax.profiler trace of updates [start_step, start_step + num_steps) into <workdir>/profile: an
    .xplane.pb for TensorBoard's profile plugin, a perfetto_trace.json.gz for ui.perfetto.dev. Off when
    profile.num_steps is 0; a resumed run past start_step traces its first num_steps updates."""

    def __init__(self, config, workdir: str):
        self.start, self.count = config.profile.start_step, config.profile.num_steps
        self.directory = os.path.join(workdir, "profile")
        self.active, self.done = False, self.count <= 0

    def before(self, step: int):
        if self._starts_before(step):
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active, self.last = True, max(step, self.start) + self.count - 1

    def after(self, step: int):
        if self._stops_after(step):
            self.stop()

    def changes_between(self, step: int, next_step: int) -> bool:
        """Whether the trace stops after `step` or starts before `next_step` (so that an update dispatched
        ahead would straddle its edge)."""
        return self._stops_after(step) or self._starts_before(next_step)

    def _starts_before(self, step: int) -> bool:
        return not self.done and not self.active and step >= self.start

    def _stops_after(self, step: int) -> bool:
        return self.active and step >= self.last

    def stop(self):
        if self.active:
            jax.profiler.stop_trace()
            self.active, self.done = False, True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
