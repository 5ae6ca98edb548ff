"""rlplat-judge: a generative judge as a reward. The ``judge`` reward manager asks a judge model, served by
the ``judge`` role's rollout, with a prompt template, and a judge parser reads the score it wrote."""
