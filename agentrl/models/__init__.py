"""Models and tokenizers: the tiny CPU model the project builds itself (`tiny`), and tokenizer loading."""
