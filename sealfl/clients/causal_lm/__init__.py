"""The causal-LM task: federated LoRA fine-tuning of a small Llama-architecture model.

Modules: :mod:`.base` (the pinned base model and how it is read), :mod:`.lora` (adapters,
the flat vector that gets encrypted, local training), :mod:`.text` (tokenised blocks and
perplexity). torch, transformers and peft are imported here -- partners and the
coordinator only; devices never import this package.
"""
