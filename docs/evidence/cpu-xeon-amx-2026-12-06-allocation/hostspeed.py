import time, torch
torch.set_num_threads(2)
a = torch.randn(1024, 1024)
t = time.perf_counter()
for _ in range(200): a @ a
mm = time.perf_counter() - t
t = time.perf_counter(); s = 0
for i in range(3_000_000): s += i
py = time.perf_counter() - t
print(f"matmul {mm:.2f} s  python {py:.2f} s")
