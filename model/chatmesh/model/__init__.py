"""The served model as chat and the engines share it: its files (assets), tokenizer, chat template and profile."""
