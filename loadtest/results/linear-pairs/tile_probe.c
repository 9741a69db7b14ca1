/* Tile-product probe for the 80-row products (eighth session, loadtest/results/linear-pairs/).
 *
 *   gcc -O3 -march=native -fopenmp tile_probe.c -o /tmp/tile_probe
 *   /tmp/tile_probe THREADS ROWS FIRST_VARIANT LAST_VARIANT [K N]
 *
 * 60 weight matrices of N x K bf16 (gate_up's 3072 x 576 by default: 212 MB, the body's
 * size) pass through the kernel's loop shape (a weight tile per k step, reused for up to
 * five 16-row blocks of x) at ROWS rows; every variant runs at five software-prefetch
 * distances, interleaved, best of 8. Variants that say "wrong math" drop a load to find
 * what binds, their sums are meaningless:
 *   0 the kernel's loop (x tiles strided from L2, weights streamed, 2 KB prefetch)
 *   1 x tiles alternating between two tile registers
 *   2 no x reloads (one x tile for every product): the weight stream and the products
 *   3 no weight stream (one weight tile): the x loads and the products
 *   4/5 x laid out tile by tile (contiguous 1 KB tiles), with / without the weight stream
 *   6 as 4 with one x tile register
 *   7 weights double-buffered, the next loaded before the current products
 *   8/9 as 0 plus a far prefetch into L2 (T1 / T2)
 *   10/11 x confined to four k tiles (so in L1), with / without the weight stream
 *   12 the products alone: AMX's own rate
 * Prints ms per pass over the 60 matrices and ns per tile product per thread.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;
static void cfg(void){ tile_config c; memset(&c,0,sizeof c); c.palette=1; for(int t=0;t<8;t++){c.colsb[t]=64;c.rows[t]=16;} _tile_loadconfig(&c);}
static double now(void){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+1e-9*t.tv_nsec;}
static int PF=2048;
/* variant 0: current; 1: alternate A tiles; */
static void run(int variant, const uint16_t* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N, float* sink, int threads){
  const int64_t col_blocks=N/16, k_tiles=K/32, rbs=(M+15)/16, xs=K*2;
#pragma omp parallel num_threads(threads)
  { cfg(); int nt=omp_get_num_threads(), id=omp_get_thread_num();
    int64_t first=col_blocks*id/nt, stop=col_blocks*(id+1)/nt;
    float out[256] __attribute__((aligned(64)));
    for(int64_t cb=first; cb<stop; cb++){
      const uint8_t* tiles=packed+cb*k_tiles*1024;
      const uint8_t* a[5]; for(int j=0;j<5;j++) a[j]=(const uint8_t*)(x+ (j<rbs?j:0)*16*K);
      int count=rbs;
      _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);_tile_zero(4);
      if(variant==0){
        for(int64_t kt=0;kt<k_tiles;kt++){ const uint8_t* b=tiles+kt*1024;
          for(int l=0;l<1024;l+=64) _mm_prefetch((const char*)b+PF+l,_MM_HINT_T0);
          _tile_loadd(7,b,64); int64_t kb=kt*64;
          _tile_loadd(5,a[0]+kb,xs); _tile_dpbf16ps(0,5,7);
          if(count>1){_tile_loadd(5,a[1]+kb,xs); _tile_dpbf16ps(1,5,7);}
          if(count>2){_tile_loadd(5,a[2]+kb,xs); _tile_dpbf16ps(2,5,7);}
          if(count>3){_tile_loadd(5,a[3]+kb,xs); _tile_dpbf16ps(3,5,7);}
          if(count>4){_tile_loadd(5,a[4]+kb,xs); _tile_dpbf16ps(4,5,7);}
        }
      } else if(variant==1){
        for(int64_t kt=0;kt<k_tiles;kt++){ const uint8_t* b=tiles+kt*1024;
          for(int l=0;l<1024;l+=64) _mm_prefetch((const char*)b+PF+l,_MM_HINT_T0);
          _tile_loadd(7,b,64); int64_t kb=kt*64;
          _tile_loadd(5,a[0]+kb,xs); _tile_dpbf16ps(0,5,7);
          if(count>1){_tile_loadd(6,a[1]+kb,xs); _tile_dpbf16ps(1,6,7);}
          if(count>2){_tile_loadd(5,a[2]+kb,xs); _tile_dpbf16ps(2,5,7);}
          if(count>3){_tile_loadd(6,a[3]+kb,xs); _tile_dpbf16ps(3,6,7);}
          if(count>4){_tile_loadd(5,a[4]+kb,xs); _tile_dpbf16ps(4,5,7);}
        }
      } else if(variant==2){ /* no A reload: compute bound probe (wrong math) */
        _tile_loadd(5,a[0],xs);
        for(int64_t kt=0;kt<k_tiles;kt++){ const uint8_t* b=tiles+kt*1024;
          for(int l=0;l<1024;l+=64) _mm_prefetch((const char*)b+PF+l,_MM_HINT_T0);
          _tile_loadd(7,b,64);
          _tile_dpbf16ps(0,5,7);
          if(count>1){ _tile_dpbf16ps(1,5,7);}
          if(count>2){ _tile_dpbf16ps(2,5,7);}
          if(count>3){ _tile_dpbf16ps(3,5,7);}
          if(count>4){ _tile_dpbf16ps(4,5,7);}
        }
      } else if(variant==3){ /* no B reload from memory: same b tile always (compute+A load) */
        _tile_loadd(7,tiles,64);
        for(int64_t kt=0;kt<k_tiles;kt++){ int64_t kb=kt*64;
          _tile_loadd(5,a[0]+kb,xs); _tile_dpbf16ps(0,5,7);
          if(count>1){_tile_loadd(6,a[1]+kb,xs); _tile_dpbf16ps(1,6,7);}
          if(count>2){_tile_loadd(5,a[2]+kb,xs); _tile_dpbf16ps(2,5,7);}
          if(count>3){_tile_loadd(6,a[3]+kb,xs); _tile_dpbf16ps(3,6,7);}
          if(count>4){_tile_loadd(5,a[4]+kb,xs); _tile_dpbf16ps(4,5,7);}
        }
      } else if(variant==4 || variant==5){ /* A packed: tile (rb,kt) at xp + (rb*k_tiles+kt)*1024 */
        const uint8_t* xp=(const uint8_t*)x; int vb=variant==5;
        for(int64_t kt=0;kt<k_tiles;kt++){ const uint8_t* b=vb?tiles:tiles+kt*1024;
          if(!vb) for(int l=0;l<1024;l+=64) _mm_prefetch((const char*)b+PF+l,_MM_HINT_T0);
          _tile_loadd(7,b,64);
          _tile_loadd(5,xp+(0*k_tiles+kt)*1024,64); _tile_dpbf16ps(0,5,7);
          if(count>1){_tile_loadd(6,xp+(1*k_tiles+kt)*1024,64); _tile_dpbf16ps(1,6,7);}
          if(count>2){_tile_loadd(5,xp+(2*k_tiles+kt)*1024,64); _tile_dpbf16ps(2,5,7);}
          if(count>3){_tile_loadd(6,xp+(3*k_tiles+kt)*1024,64); _tile_dpbf16ps(3,6,7);}
          if(count>4){_tile_loadd(5,xp+(4*k_tiles+kt)*1024,64); _tile_dpbf16ps(4,5,7);}
        }
      } else if(variant==6){ /* packed A, single A tile */
        const uint8_t* xp=(const uint8_t*)x;
        for(int64_t kt=0;kt<k_tiles;kt++){ const uint8_t* b=tiles+kt*1024;
          for(int l=0;l<1024;l+=64) _mm_prefetch((const char*)b+PF+l,_MM_HINT_T0);
          _tile_loadd(7,b,64);
          _tile_loadd(5,xp+(0*k_tiles+kt)*1024,64); _tile_dpbf16ps(0,5,7);
          if(count>1){_tile_loadd(5,xp+(1*k_tiles+kt)*1024,64); _tile_dpbf16ps(1,5,7);}
          if(count>2){_tile_loadd(5,xp+(2*k_tiles+kt)*1024,64); _tile_dpbf16ps(2,5,7);}
          if(count>3){_tile_loadd(5,xp+(3*k_tiles+kt)*1024,64); _tile_dpbf16ps(3,5,7);}
          if(count>4){_tile_loadd(5,xp+(4*k_tiles+kt)*1024,64); _tile_dpbf16ps(4,5,7);}
        }
      } else if(variant==7){ /* B double-buffered, next B loaded before current dps */
        const uint8_t* b=tiles; const int64_t kb0=0;
        for(int l=0;l<1024;l+=64) _mm_prefetch((const char*)b+PF+l,_MM_HINT_T0);
        _tile_loadd(7,b,64);
        for(int64_t kt=0;kt<k_tiles;kt+=2){ int64_t kb=kt*64;
          const uint8_t* bn=tiles+(kt+1)*1024;
          for(int l=0;l<1024;l+=64) _mm_prefetch((const char*)bn+PF+l,_MM_HINT_T0);
          if(kt+1<k_tiles) _tile_loadd(6,bn,64);
          _tile_loadd(5,a[0]+kb,xs); _tile_dpbf16ps(0,5,7);
          _tile_loadd(5,a[1]+kb,xs); _tile_dpbf16ps(1,5,7);
          _tile_loadd(5,a[2]+kb,xs); _tile_dpbf16ps(2,5,7);
          _tile_loadd(5,a[3]+kb,xs); _tile_dpbf16ps(3,5,7);
          _tile_loadd(5,a[4]+kb,xs); _tile_dpbf16ps(4,5,7);
          if(kt+1>=k_tiles) break;
          kb+=64; const uint8_t* bn2=tiles+(kt+2)*1024;
          for(int l=0;l<1024;l+=64) _mm_prefetch((const char*)bn2+PF+l,_MM_HINT_T0);
          if(kt+2<k_tiles) _tile_loadd(7,bn2,64);
          _tile_loadd(5,a[0]+kb,xs); _tile_dpbf16ps(0,5,6);
          _tile_loadd(5,a[1]+kb,xs); _tile_dpbf16ps(1,5,6);
          _tile_loadd(5,a[2]+kb,xs); _tile_dpbf16ps(2,5,6);
          _tile_loadd(5,a[3]+kb,xs); _tile_dpbf16ps(3,5,6);
          _tile_loadd(5,a[4]+kb,xs); _tile_dpbf16ps(4,5,6);
        }
        (void)kb0;
      } else if(variant==8 || variant==9){ /* as 0 plus far T1 (8) or T2 (9) prefetch */
        for(int64_t kt=0;kt<k_tiles;kt++){ const uint8_t* b=tiles+kt*1024;
          for(int l=0;l<1024;l+=64) _mm_prefetch((const char*)b+2048+l,_MM_HINT_T0);
          if(variant==8) for(int l=0;l<1024;l+=64) _mm_prefetch((const char*)b+PF+l,_MM_HINT_T1);
          else for(int l=0;l<1024;l+=64) _mm_prefetch((const char*)b+PF+l,_MM_HINT_T2);
          _tile_loadd(7,b,64); int64_t kb=kt*64;
          _tile_loadd(5,a[0]+kb,xs); _tile_dpbf16ps(0,5,7);
          if(count>1){_tile_loadd(5,a[1]+kb,xs); _tile_dpbf16ps(1,5,7);}
          if(count>2){_tile_loadd(5,a[2]+kb,xs); _tile_dpbf16ps(2,5,7);}
          if(count>3){_tile_loadd(5,a[3]+kb,xs); _tile_dpbf16ps(3,5,7);}
          if(count>4){_tile_loadd(5,a[4]+kb,xs); _tile_dpbf16ps(4,5,7);}
        }
      } else if(variant==10 || variant==11){ /* A confined to L1 (4 k-tiles cycled): wrong math */
        int fixedb = variant==11;
        for(int64_t kt=0;kt<k_tiles;kt++){ const uint8_t* b=fixedb?tiles:tiles+kt*1024;
          if(!fixedb){ for(int l=0;l<1024;l+=64) _mm_prefetch((const char*)b+2048+l,_MM_HINT_T0);
          for(int l=0;l<1024;l+=64) _mm_prefetch((const char*)b+PF+l,_MM_HINT_T2);}
          _tile_loadd(7,b,64); int64_t kb=(kt&3)*64;
          _tile_loadd(5,a[0]+kb,xs); _tile_dpbf16ps(0,5,7);
          _tile_loadd(5,a[1]+kb,xs); _tile_dpbf16ps(1,5,7);
          _tile_loadd(5,a[2]+kb,xs); _tile_dpbf16ps(2,5,7);
          _tile_loadd(5,a[3]+kb,xs); _tile_dpbf16ps(3,5,7);
          _tile_loadd(5,a[4]+kb,xs); _tile_dpbf16ps(4,5,7);
        }
      } else if(variant==12){
        for(int64_t kt=0;kt<k_tiles;kt++){
          _tile_dpbf16ps(0,5,7); _tile_dpbf16ps(1,5,7); _tile_dpbf16ps(2,5,7); _tile_dpbf16ps(3,5,7); _tile_dpbf16ps(4,5,7);
        }
      }
      _tile_stored(0,out,64); sink[id*16]+=out[3];
      if(count>4){_tile_stored(4,out,64); sink[id*16]+=out[5];}
    }
    _tile_release();
  }
}
int main(int argc,char**argv){
  syscall(SYS_arch_prctl,0x1023,18);
  int threads=atoi(argv[1]); int64_t M=atoi(argv[2]);
  int64_t K=argc>5?atoi(argv[5]):576, N=argc>6?atoi(argv[6]):3072; /* gate_up-like; total weights per 'layer' 3.5MB */
  int layers=60; /* ~212MB */
  size_t wbytes=(size_t)N*K*2;
  uint8_t* w=aligned_alloc(64,wbytes*layers); for(size_t i=0;i<wbytes*layers;i++) w[i]=(i*7)&0x3f;
  uint16_t* x=aligned_alloc(64,80*K*2); for(int i=0;i<80*K;i++) x[i]=0x3f80;
  float sink[64]={0};
  int v0=atoi(argv[3]), v1=atoi(argv[4]); double best[16][8]; int pfs[5]={8192,16384,32768,65536,131072};
  for(int v=0;v<16;v++)for(int p=0;p<5;p++)best[v][p]=1e9;
  for(int rep=0;rep<8;rep++) for(int v=v0; v<=v1; v++) for(int p=0;p<5;p++){ PF=pfs[p]; double t0=now();
      for(int l=0;l<layers;l++) run(v,x,M,K,w+wbytes*l,N,sink,threads);
      double t=now()-t0; if(t<best[v][p])best[v][p]=t;}
  double ops=(double)layers*(N/16)*(K/32)*((M+15)/16);
  for(int v=v0; v<=v1; v++){ printf("variant %d M=%ld thr=%d:",v,M,threads); for(int p=0;p<5;p++) printf(" PF%d %.2fms(%.1fns)",pfs[p]/1024,best[v][p]*1e3,best[v][p]*1e9*threads/ops); printf("\n");}
  return (int)sink[0]&1;
}
