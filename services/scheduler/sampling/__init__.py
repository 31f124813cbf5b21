"""What a token is chosen from and how: logit adjustments, structured-output masks, the draw, and logprob rows."""
