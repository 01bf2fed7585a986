import grpo_ds

metrics = grpo_ds.train("recipes/tiny_cpu.json", overrides={"train.steps": 20})
print(metrics[-1]["reward_mean"])
