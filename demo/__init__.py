"""The embedded demo models, built from nothing on CPU in a few minutes.

`python -m demo.build` generates support-desk conversations (`corpus`), trains a
byte-level BPE tokenizer (`tokenizer`), trains a 4-layer Llama target and a 1-layer draft
(`train`), checks them (`evaluate`) and installs both as Hugging Face directories that
`paths.resolve_model("demo")` / `resolve_model("demo-draft")` find.
"""
