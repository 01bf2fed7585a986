"""Learned reward models (recipe key ``reward.models``): sequence-classification models with one label, scored on
every trainer rank like the reference model. Their folders checked before anything loads (``checks``), each prompt +
completion rendered as text and re-tokenized with the reward model's own tokenizer (``render``), the models loaded
partitioned and scored in token micro-batches (``scorer``), and tiny reward models built in code (``tiny``).
"""
