/* Guard pages for tensor storages: a late reader or writer of freed memory faults at once.
 *
 * Preloaded (LD_PRELOAD) into a CPU training process, it serves posix_memalign, aligned_alloc
 * and memalign, which torch's CPU allocator (c10::alloc_cpu) uses for every tensor storage.
 * Each block gets pages of its own at the end of which it ends (an access past the end faults
 * on the next, inaccessible page); a freed block is made inaccessible (PROT_NONE) and never
 * handed out again, so a late access faults where it happens instead of corrupting whatever
 * reused the memory. glibc's own heap checks (MALLOC_CHECK_, MALLOC_PERTURB_) see such a
 * write only if the memory was reused or a chunk header was hit, and only later. Everything
 * else (malloc, free of other blocks) goes to glibc. Address space is reserved once (4 TiB,
 * never backed) and each block costs at least two pages of it: for test runs only.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define REGION (1ULL << 42)
#define MAGIC 0x6775617264ULL

struct header { uint64_t start, pages, size, magic; };

static char *region;
static uint64_t used;
static long page = 4096;

static void reserve(void) {
  if (__atomic_load_n(&region, __ATOMIC_ACQUIRE)) return;
  page = sysconf(_SC_PAGESIZE);
  void *r = mmap(NULL, REGION, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) { perror("guard_pages: reserving address space"); abort(); }
  char *expected = NULL;
  if (!__atomic_compare_exchange_n(&region, &expected, (char *)r, 0, __ATOMIC_ACQ_REL,
                                   __ATOMIC_ACQUIRE))
    munmap(r, REGION);  /* another thread reserved first */
}

static int ours(void *p) {
  char *r = __atomic_load_n(&region, __ATOMIC_ACQUIRE);
  return r && (char *)p >= r && (char *)p < r + REGION;
}

int posix_memalign(void **out, size_t align, size_t size) {
  reserve();
  if (align < 16) align = 16;
  uint64_t pages = (size + sizeof(struct header) + align + page - 1) / page;
  uint64_t offset = __atomic_fetch_add(&used, (pages + 1) * page, __ATOMIC_SEQ_CST);
  if (offset + (pages + 1) * page > REGION) return ENOMEM;
  char *start = region + offset;
  if (mprotect(start, pages * page, PROT_READ | PROT_WRITE)) return ENOMEM;
  char *user = (char *)(((uintptr_t)(start + pages * page - size)) & ~(uintptr_t)(align - 1));
  struct header *h = (struct header *)user - 1;
  h->start = (uint64_t)start;
  h->pages = pages;
  h->size = size;
  h->magic = MAGIC;
  *out = user;
  return 0;
}

void *aligned_alloc(size_t align, size_t size) {
  void *p;
  return posix_memalign(&p, align, size) ? NULL : p;
}

void *memalign(size_t align, size_t size) {
  void *p;
  return posix_memalign(&p, align, size) ? NULL : p;
}

void free(void *p) {
  if (p && ours(p)) {
    struct header *h = (struct header *)p - 1;
    if (h->magic != MAGIC) { fprintf(stderr, "guard_pages: bad free %p\n", p); abort(); }
    /* Read before the pages go: the header lives in them. */
    void *start = (void *)h->start;
    size_t nbytes = h->pages * page;
    h->magic = 0;
    madvise(start, nbytes, MADV_DONTNEED);
    mprotect(start, nbytes, PROT_NONE);
    return;
  }
  static void (*next)(void *);
  if (!next) next = (void (*)(void *))dlsym(RTLD_NEXT, "free");
  next(p);
}

void *realloc(void *p, size_t size) {
  if (p && ours(p)) {
    struct header *h = (struct header *)p - 1;
    void *q;
    if (posix_memalign(&q, 64, size)) return NULL;
    memcpy(q, p, h->size < size ? h->size : size);
    free(p);
    return q;
  }
  static void *(*next)(void *, size_t);
  if (!next) next = (void *(*)(void *, size_t))dlsym(RTLD_NEXT, "realloc");
  return next(p, size);
}

size_t malloc_usable_size(void *p) {
  if (p && ours(p)) return ((struct header *)p - 1)->size;
  static size_t (*next)(void *);
  if (!next) next = (size_t (*)(void *))dlsym(RTLD_NEXT, "malloc_usable_size");
  return next(p);
}
