"""What a state dtype does to a model's answers: a long-memory task, a Mamba2 model decoding through ssu.

:mod:`.recall` is the task (key-value pairs recited after a long run of filler tokens),
:mod:`.model` a Mamba2 language model of transformers' checkpoint layout whose every SSU step goes
through an ssu kernel at a chosen state dtype, and :mod:`.study` the figures: the task's accuracy,
greedy-token agreement with fp32 states, and the state's drift from fp32 over long decodes. Each
module imports torch when called.
"""
