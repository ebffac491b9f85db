"""The training objective: `objective` (log-magnitude MSE and the auxiliary terms, `LossConfig`,
feature statistics) and `perceptual` (a differentiable model of wideband PESQ's disturbance)."""
