"""Training data: dataset.py (mock or Megatron's GPTDataset; the microbatch interface both
trainers read), mock.py, tokenizer.py, preprocess.py (Megatron's preprocess_data.py), corpus.py
(a real corpus built from Python's installed docs)."""
