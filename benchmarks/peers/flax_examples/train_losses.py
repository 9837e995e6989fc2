# Copyright 2024 The Flax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

# mpjax peer set: the loss functions of the Flax examples' training scripts, copied
# from google/flax at commit 18f8f311c275d57f46d95e41b15aa97b454754c0. The training
# scripts themselves import tensorflow, ml_collections and their input pipelines, so
# only these functions are taken. Each function body is unmodified; the functions
# that share a name are given the example's name as a prefix, and the imports are
# gathered at the top.

from flax import linen as nn
from flax import nnx
from flax.training import common_utils
import jax
import jax.numpy as jnp
import numpy as np
import optax


# --- examples/vae/train.py ---------------------------------------------------


@jax.vmap
def kl_divergence(mean, logvar):
  return -0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar))


@jax.vmap
def binary_cross_entropy_with_logits(logits, labels):
  logits = nn.log_sigmoid(logits)
  return -jnp.sum(
      labels * logits + (1.0 - labels) * jnp.log(-jnp.expm1(logits))
  )


# --- examples/imagenet/train.py ----------------------------------------------

NUM_CLASSES = 1000  # imagenet/train.py's constant; the peer passes its own below.


def imagenet_cross_entropy_loss(logits, labels, num_classes=NUM_CLASSES):
  # (num_classes added as an argument: upstream reads the module constant.)
  one_hot_labels = common_utils.onehot(labels, num_classes=num_classes)
  xentropy = optax.softmax_cross_entropy(logits=logits, labels=one_hot_labels)
  return jnp.mean(xentropy)


def imagenet_weight_penalty(params):
  # The weight decay term of imagenet/train.py's loss_fn, as written there.
  weight_penalty_params = jax.tree_util.tree_leaves(params)
  weight_decay = 0.0001
  weight_l2 = sum(
      jnp.sum(x**2) for x in weight_penalty_params if x.ndim > 1
  )
  weight_penalty = weight_decay * 0.5 * weight_l2
  return weight_penalty


# --- examples/lm1b/train.py --------------------------------------------------


def lm1b_compute_weighted_cross_entropy(
    logits, targets, weights=None, label_smoothing=0.0
):
  """Compute weighted cross entropy and entropy for log probs and targets.

  Args:
   logits: [batch, length, num_classes] float array.
   targets: categorical targets [batch, length] int array.
   weights: None or array of shape [batch, length].
   label_smoothing: label smoothing constant, used to determine the on and off
     values.

  Returns:
    Tuple of scalar loss and batch normalizing factor.
  """
  if logits.ndim != targets.ndim + 1:
    raise ValueError(
        "Incorrect shapes. Got shape %s logits and %s targets"
        % (str(logits.shape), str(targets.shape))
    )
  vocab_size = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low_confidence = (1.0 - confidence) / (vocab_size - 1)
  normalizing_constant = -(
      confidence * jnp.log(confidence)
      + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
  )
  soft_targets = common_utils.onehot(
      targets, vocab_size, on_value=confidence, off_value=low_confidence
  )

  loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1)
  loss = loss - normalizing_constant

  normalizing_factor = np.prod(targets.shape)
  if weights is not None:
    loss = loss * weights
    normalizing_factor = weights.sum()

  return loss.sum(), normalizing_factor


# --- examples/sst2/train.py --------------------------------------------------


def sigmoid_cross_entropy_with_logits(*, labels, logits):
  """Sigmoid cross entropy loss."""
  zeros = jnp.zeros_like(logits, dtype=logits.dtype)
  condition = logits >= zeros
  relu_logits = jnp.where(condition, logits, zeros)
  neg_abs_logits = jnp.where(condition, -logits, logits)
  return relu_logits - logits * labels + jnp.log1p(jnp.exp(neg_abs_logits))


# --- examples/gemma/train.py -------------------------------------------------


def gemma_compute_weighted_cross_entropy(
    logits, targets, weights=None, label_smoothing=0.0
):
  """Compute weighted cross entropy and entropy for log probs and targets.

  Args:
   logits: [batch, length, num_classes] float array.
   targets: categorical targets [batch, length] int array.
   weights: None or array of shape [batch, length].
   label_smoothing: label smoothing constant, used to determine the on and off
     values.

  Returns:
    Tuple of scalar loss and batch normalizing factor.
  """
  if logits.ndim != targets.ndim + 1:
    raise ValueError(
        'Incorrect shapes. Got shape %s logits and %s targets'
        % (str(logits.shape), str(targets.shape))
    )
  vocab_size = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low_confidence = (1.0 - confidence) / (vocab_size - 1)
  normalizing_constant = -(
      confidence * jnp.log(confidence)
      + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
  )
  soft_targets = (
      jax.nn.one_hot(targets, vocab_size) * (confidence - low_confidence)
      + low_confidence
  )

  loss = -jnp.sum(soft_targets * nnx.log_softmax(logits), axis=-1)
  loss = loss - normalizing_constant

  normalizing_factor = np.prod(targets.shape)
  if weights is not None:
    loss = loss * weights
    normalizing_factor = weights.sum()

  # loss shape is [B, T]
  loss_per_sample = loss.sum(axis=1) * len(loss) / normalizing_factor
  return loss_per_sample
