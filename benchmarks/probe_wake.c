// Build and run: gcc -O2 -o /tmp/probe_wake benchmarks/probe_wake.c -lpthread && for m in 0 1 2; do /tmp/probe_wake $m 2000 40; done
// (benchmarks/README.md, "Idle polling"): the wake-up mechanisms alone, without Python.
// Round-trip probe: worker (core 1) "steps" (sleep 2 ms), publishes, waits for the answer;
// server (core 0) waits for a request, computes ~40 us, answers.
// mode 0: eventfd both ways (blocking read)     mode 1: SCHED_IDLE poller thread per process
// spins on the shared word and futex-wakes the main thread on its own core
// mode 2: main threads spin (lower bound)
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <unistd.h>
#include <sched.h>
#include <pthread.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <linux/futex.h>
#include <stdatomic.h>

typedef struct { _Atomic uint64_t req; char pad[56]; _Atomic uint64_t resp; char pad2[56]; } shared_t;
static shared_t *sh; static int efd_req, efd_resp; static int mode; static int rounds = 500;
static double now_us(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);sched_setaffinity(0,sizeof s,&s);}
static void spin_us(double us){double e=now_us()+us;while(now_us()<e);}
static long futex(_Atomic int *a,int op,int v){return syscall(SYS_futex,a,op,v,NULL,NULL,0);}

// poller state (process-local)
static _Atomic uint64_t *watched; static _Atomic uint64_t expect; static _Atomic int waiting; static _Atomic int stop;
static void *poller(void *arg){
  int c=(int)(intptr_t)arg; pin(c);
  struct sched_param p={0}; sched_setscheduler(0,SCHED_IDLE,&p);
  while(!atomic_load(&stop)){
    if(atomic_load(&waiting)==1 && atomic_load(watched)>=atomic_load(&expect)){
      int one=1; if(atomic_compare_exchange_strong(&waiting,&one,0)) futex(&waiting,FUTEX_WAKE_PRIVATE,1);
    }
    __builtin_ia32_pause();
  }
  return NULL;
}
static void wait_for(_Atomic uint64_t *w, uint64_t v, int efd){
  if(mode==0){uint64_t x; if(read(efd,&x,8)!=8) perror("read"); return;}
  if(mode==2){while(atomic_load(w)<v) __builtin_ia32_pause(); return;}
  atomic_store(&expect,v); atomic_store(&waiting,1);
  while(atomic_load(w)<v){ if(atomic_load(&waiting)==0) break; futex(&waiting,FUTEX_WAIT_PRIVATE,1);}  
  atomic_store(&waiting,0);
}
static void ring(int efd){ if(mode==0){uint64_t one=1; if(write(efd,&one,8)!=8) perror("write");} }

int main(int argc,char**argv){
  mode=atoi(argv[1]); double step_us=argc>2?atof(argv[2]):2000; double pol_us=argc>3?atof(argv[3]):40;
  sh=mmap(NULL,4096,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0);
  efd_req=eventfd(0,EFD_SEMAPHORE); efd_resp=eventfd(0,EFD_SEMAPHORE);
  pid_t s=fork();
  if(s==0){ // server on core 0
    pin(0); pthread_t t; watched=&sh->req; if(mode==1) pthread_create(&t,NULL,poller,(void*)0);
    for(uint64_t i=1;i<=(uint64_t)rounds;i++){ wait_for(&sh->req,i,efd_req); spin_us(pol_us); atomic_store(&sh->resp,i); ring(efd_resp);} 
    atomic_store(&stop,1); if(mode==1) pthread_join(t,NULL); _exit(0);
  }
  pin(1); pthread_t t; watched=&sh->resp; if(mode==1) pthread_create(&t,NULL,poller,(void*)1);
  double *lat=malloc(sizeof(double)*rounds);
  for(uint64_t i=1;i<=(uint64_t)rounds;i++){
    struct timespec ts={0,(long)(step_us*1000)}; if(step_us>0) nanosleep(&ts,NULL);
    double t0=now_us(); atomic_store(&sh->req,i); ring(efd_req); wait_for(&sh->resp,i,efd_resp); lat[i-1]=now_us()-t0-pol_us;
  }
  atomic_store(&stop,1); if(mode==1) pthread_join(t,NULL); waitpid(s,NULL,0);
  // median
  for(int i=0;i<rounds;i++)for(int j=i+1;j<rounds;j++)if(lat[j]<lat[i]){double x=lat[i];lat[i]=lat[j];lat[j]=x;}
  printf("mode %d step %.0f us policy %.0f us: round trip beyond the policy: median %.1f us, p90 %.1f us\n",mode,step_us,pol_us,lat[rounds/2],lat[rounds*9/10]);
  return 0;
}
