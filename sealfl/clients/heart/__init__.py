"""The ``heart`` task: logistic regression on Fed-Heart-Disease (:mod:`.task`), the data and
FLamby's split (:mod:`.data`), scaling statistics (:mod:`.stats`), candidate scoring in the
sandbox (:mod:`.onnx_eval`) and the benchmark-only variants (:mod:`.bench`)."""
