"""The training graph: a model's network made into one training step as Relax functions.

The stage between :mod:`thomas_tune.models` (the networks, traced to a forward graph) and
:mod:`thomas_tune.tasks` (the step's kernels, which tuning works on): the forward pass, the loss,
the gradients, the optimizer's update and the functions an export's ``train.so`` holds. Named
after what it builds, the *training graph* (the term of these docstrings and of TVM's
``relax.training``), not ``training``: beside :mod:`thomas_tune.train` (the fine-tuning loop over
an export) that name would read as the loop's home.

Modules:

* :mod:`.graph`: model -> Relax module with ``predict``, ``train_adjoint`` and ``optimizer``;
* :mod:`.gradients`: the gradients the pinned TVM lacks, registered as ``FPrimalGradient``;
* :mod:`.loss`: softmax cross-entropy averaged over the batch, in one kernel;
* :mod:`.optimizers`: the step's optimizers (SGD, SGD with momentum, Adam), as multi-tensor kernels;
* :mod:`.multi_tensor`: the multi-tensor kernels: many parameters' update in one launch;
* :mod:`.dropout`: dropout masks drawn on the device (:mod:`thomas_tune.counter_random`);
* :mod:`.pooling`: max pooling with small windows as one injective kernel;
* :mod:`.winograd_form`: a stride-1 convolution as transforms around a batched matmul;
* :mod:`.lift`: the frozen parameters' transforms computed once, not at every step;
* :mod:`.library_module`: the Relax module a training library is compiled from (the graph's
  functions, the packing functions, ``draw_masks``, ``TRAIN_STEP``, the lifting marks).

The BatchNorm forms stay in ``models/batchnorm.py``: the networks' graph builder
(:class:`thomas_tune.models.layers.Graph`) emits them, and a model may not import this stage.
"""
