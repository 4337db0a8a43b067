"""Parameter-efficient fine-tuning: LoRA adapters on the layer matrices (lora.py), the frozen base's
storage in int8 / NF4 blocks (quant.py), the train state's split into adapters and base, merging
(tree.py), and PEFT's adapter format (peft.py writes it, peft_read.py reads it)."""
