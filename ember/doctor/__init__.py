"""`ember doctor`: controlled experiments and a ranked diagnosis of step time."""
