"""Colocated engines take their memory back only after the actor's ranks returned their
allocators' cached blocks (SGLang's memory saver maps its pages back into what is free)."""

from __future__ import annotations

from dapo_megatron.run.system import give_engines_their_memory_back


def test_the_actor_frees_its_cached_memory_before_the_engines_resume():
    calls: list[str] = []

    class Actor:
        def free_cached_memory(self):
            calls.append("actor frees its cached blocks")

    class Engines:
        def resume_memory(self):
            calls.append("engines resume")

    give_engines_their_memory_back(Actor(), Engines())
    assert calls == ["actor frees its cached blocks", "engines resume"]
