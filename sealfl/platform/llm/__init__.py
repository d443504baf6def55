"""The causal-LM release path inside the release enclave: merge the aggregated LoRA
adapters into the base (:mod:`.merge`), export ONNX with a KV cache (:mod:`.export`),
quantise to INT4/INT8 (:mod:`.quantize`), gate against the fp32 merged model
(:mod:`.gate`) and build the signed canary (:mod:`.canary`)."""
