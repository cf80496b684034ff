"""Faults injected into an engine core process (step26 on): AsyncLLM(..., _core_setup=inject_faults) calls this in
the core once its LLM is built. A module of its own, so that the core process (spawned: it imports what it runs)
can import it by name. Requests ask for a fault by their seed:

- STEP_FAILURE_SEED: the engine step that serves the request after its first token raises (inside the step: the
  step's requests are dropped, each gets the error, and the core serves on);
- DEATH_SEED: adding the request raises a RuntimeError (outside a step: the core's loop dies).
"""
STEP_FAILURE_SEED = 4242
DEATH_SEED = 4343


def inject_faults(llm) -> None:
    execute, add = llm.runner.execute, llm._add

    def failing_execute(work, *args, **kwargs):
        if any(seq.params.seed == STEP_FAILURE_SEED and seq.output_ids for seq, _ in work):
            raise RuntimeError("injected failure")
        return execute(work, *args, **kwargs)

    def failing_add(prompt, ids, params, *args, **kwargs):
        if params.seed == DEATH_SEED:
            raise RuntimeError("injected failure outside a step")
        return add(prompt, ids, params, *args, **kwargs)

    llm.runner.execute, llm._add = failing_execute, failing_add
