"""What tests share: independent references, data builders (no tests here)."""
