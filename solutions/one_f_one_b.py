"""Lesson 03: one pipeline stage's step in 1F1B's order, from send and recv."""


def my_one_f_one_b(stage):
    """Run the step's micro-batches on this stage: P - s - 1 warm-up forwards, then one
    forward and one backward in turn, then the backwards left."""
    s, P, M = stage.index, stage.stages, stage.microbatches
    first, last = s == 0, s == P - 1

    def forward(m):
        x = None if first else stage.recv(s - 1)  # the activation from the stage before
        y = stage.forward(m, x)
        if not last:
            stage.send(y, s + 1)

    def backward(m):
        dy = None if last else stage.recv(s + 1)  # the gradient from the stage after
        dx = stage.backward(m, dy)
        if not first:
            stage.send(dx, s - 1)

    warmup = min(P - s - 1, M)  # enough forwards to fill the stages below
    for m in range(warmup):
        forward(m)
    for i in range(M - warmup):  # steady state: one forward, then the oldest backward
        forward(warmup + i)
        backward(i)
    for m in range(M - warmup, M):  # drain
        backward(m)
