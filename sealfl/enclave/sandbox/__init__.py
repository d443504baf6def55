"""The sandboxed inference child and the parent that runs it.

:mod:`.runtime` (parent: :class:`~.runtime.SandboxedRuntime`) starts :mod:`.child` as a
script; :mod:`.pipe` and :mod:`.stage` move requests and the model's bytes; :mod:`.setup`
checks options and makes private directories; the LLM runtime (:mod:`.llm_runtime`) runs
:mod:`.llm_child`, which decodes with :mod:`.decode`. :mod:`.child`, :mod:`.llm_child` and
:mod:`.decode` import nothing of sealfl (the child loads them by path). Devices run it
(measured into PCR 16); partners score release candidates in the same sandbox.
"""
