"""kvlab's fuzzer: seeded mutations of model files (the embedded SmolLM2 GGUF, a tiny llama GGUF and HF folder),
run through `kvlab info | plan | generate` and the Python API in worker processes under time and memory
limits, optionally with the C kernels built with AddressSanitizer. `python -m kvlab.fuzz --help`; `make fuzz`.

formats.py  the GGUF / safetensors / HF-folder layouts edits act on
seeds.py    the unmutated inputs
mutate.py   mutation kinds -> cases (lists of plain edits) -> files
worker.py   the subprocess that runs one case's steps and records each outcome
run.py      batches, limits, classification, corpus, report
"""
