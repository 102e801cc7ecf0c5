"""EAGLE-3 training: self-distilled data (``gen_data``) and the DeepSpeed trainer with training-time test
(``main``). See README.md in this folder."""
