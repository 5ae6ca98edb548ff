"""rlplat-reward-model: a reward model as a worker role. A one-label sequence classifier served by a
training engine's forward path scores each response; its score joins the reward manager's per
``reward.model.combine``."""
